"""Move bytes: send one request to the replica a policy picked, relay its response as it arrives.

Retries happen only before the first byte reaches the client, and only when the replica never
got the request (connect failures) or refused it (502/503). A replica that got it and then timed
out is not retried: it may still be working, and a long generation would run twice. After the
first byte, an upstream failure or timeout ends an SSE stream with one clean error event at an
event boundary (never half a JSON line). On a prefill/decode-disaggregated fleet each attempt is
a pair of requests (router/pd_relay.py), whose decode answer is relayed here the same way. A
response's body is relayed by router/stream_relay.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web

from ..metrics.router_metrics import RouterMetrics
from ..policies.domain import RequestSummary
from .admission import Ticket
from .admission_gate import AdmissionGate, AdmissionRejected
from .affinity import AffinityStore
from .config import UpstreamConfig
from .data_http import Answer, Request, WholeResponse
from .decision_log import DecisionLog, decision_line, request_fields
from .engine import RoutingEngine
from .errors import error_response
from .headers import REQUEST_ID, drop_set, end_to_end
from .placement import Placement, RequestRoute
from .json_splice import SplicedBody, body_bytes
from .tracing import RequestTrace, Tracing
from .ranks import routed_body
from .stream_relay import StreamRelay

if TYPE_CHECKING:
    from .pd_relay import PDForwarder
from .usage import UsageAccount
from .upstream_errors import UpstreamBodyError, UpstreamConnectError, UpstreamConnectTimeout, UpstreamTimeout
from .upstream_http import UpstreamPool
from .upstream_response import UpstreamResponse

# Non-streaming bodies up to this size are read whole and sent with the headers in one write.
_BUFFER_LIMIT = 8 * 1024 * 1024
log = logging.getLogger("kvrouter.relay")
REPLICA_HEADER = "x-kvrouter-replica"
WORKER_HEADER = "x-kvrouter-worker"  # with replica_header under --workers N: which worker answered


class Relay(StreamRelay):
    def __init__(
        self,
        engine: RoutingEngine,
        affinity: AffinityStore,
        metrics: RouterMetrics,
        config: UpstreamConfig,
        clock: Callable[[], float] = time.monotonic,
        replica_header: bool = False,
        drop_headers: tuple[str, ...] = (),
        inject_headers: dict[str, str] | None = None,
        worker: int | None = None,
    ) -> None:
        self.replica_header = replica_header
        self.worker_id = str(worker) if worker is not None else None
        # Client headers never forwarded (routing hints, the client's own API key) and headers
        # the router adds to every upstream request (its replica credentials).
        self.drop_headers = drop_headers
        self._drop = drop_set(drop_headers)
        self._no_drop = drop_set()
        self.inject_headers = dict(inject_headers or {})
        self.engine = engine
        self.admission: AdmissionGate | None = None  # set by the composition root when configured
        self.pd: PDForwarder | None = None  # set on a prefill/decode-disaggregated fleet
        self.affinity = affinity
        self.metrics = metrics
        self.config = config
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None  # control plane: /v1/models
        self._loop: asyncio.AbstractEventLoop | None = None  # the running one, from start()
        self.pool = UpstreamPool(config.connect_timeout_s, config.total_timeout_s,  # requests
                                 header_timeout_s=config.header_timeout_s,
                                 idle_timeout_s=config.idle_timeout_s)
        self._active: set[asyncio.Task[object]] = set()  # handlers forwarding a request now
        self._cut: set[asyncio.Task[object]] = set()  # of those, the ones cut_requests cancelled
        self._cut_reason = ""
        self.decision_log: DecisionLog | None = None  # one line per request when set
        self.tracing: Tracing | None = None  # OpenTelemetry spans per request when set
        self.timeout = aiohttp.ClientTimeout(
            total=config.total_timeout_s, sock_connect=config.connect_timeout_s
        )

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()  # (asking asyncio per request costs a getpid())
        connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True, ttl_dns_cache=10)
        # Bytes pass through untouched: no decompression, no headers the client did not send.
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            timeout=self.timeout,
            headers=self.inject_headers,  # also on /v1/models (the poller sends them itself)
        )

    def cut_requests(self, reason: str) -> int:
        """End every request being forwarded now (the shutdown grace is over): a stream already
        started gets an SSE error event, anything else a 503; the replicas' requests are aborted.
        Called once per process: a second call would also cancel handlers writing that error."""
        self._cut_reason = reason
        for task in self._active - self._cut:
            self._cut.add(task)
            task.cancel()
        return len(self._cut)

    def _was_cut(self, task: asyncio.Task[object]) -> bool:
        """True if `task`'s cancellation is only cut_requests' (then it is withdrawn). Asked once
        per cut: a cancellation that also had another source propagates, and is not asked again."""
        if task not in self._cut:
            return False
        self._cut.discard(task)
        return task.uncancel() == 0

    async def close(self) -> None:
        await self.pool.close()
        if self.session is not None:
            await self.session.close()

    async def forward(
        self,
        request: Request,
        body: bytes | SplicedBody,
        summary: RequestSummary,
        request_id: str,
        target: str | None = None,
        *,
        prompt_bytes: int = 0,
        drop_usage: bool = False,
        ticket: Ticket | None = None,
        received: float | None = None,
    ) -> Answer:
        """Route and relay one client request; the session's in-flight count spans all attempts
        (the engine's `route` acquires and ends it). `target` (a validated, known replica from
        a routing hint) bypasses the policy. The replica's reported usage goes to the placement
        (`prompt_bytes`: the prompt text's size, for calibration); `drop_usage`: the router
        asked for the stream's usage event, so the client does not get it. `ticket`: the
        request goes through admission control first (it may wait, or get 429). `received`:
        when the handler got the request (this relay's clock), for the decision log's time the
        router spent before sending it."""
        task = asyncio.current_task(self._loop)
        assert task is not None
        self._active.add(task)
        logged = self.decision_log is not None
        arrived, started = (time.time(), self.clock()) if logged else (0.0, 0.0)
        status = 499  # the client went away, unless a response says otherwise
        route: RequestRoute | None = None
        trace = (self.tracing.begin(request.method, request.path, request.headers, request_id)
                 if self.tracing is not None else None)
        try:
            async with self.engine.route(summary, self.affinity, target) as route:
                decide_ns = time.time_ns() if trace is not None else 0  # when the decision began
                gate = self.admission
                if ticket is not None and gate is not None and target is None:
                    try:
                        placement = await gate.place(route, ticket)
                    except AdmissionRejected as err:
                        status = 429
                        return error_response(429, str(err), "rate_limit_error", {
                            REQUEST_ID: request_id, "Retry-After": str(err.retry_after_s)})
                else:  # its decision notes, if any, once the request is sent (`_attempts`)
                    placement = route.place(defer_notes=self.pd is None)
                response = await self._attempts(
                    request, body, route, placement, request_id,
                    UsageAccount(request.path, prompt_bytes, drop_usage), trace, decide_ns)
                status = response.status
                return response
        except asyncio.CancelledError:
            if not self._was_cut(task):
                raise  # the client went away, or something else cancels this handler
            status = 503
            return error_response(503, self._cut_reason, "service_unavailable",
                                  {REQUEST_ID: request_id, "Connection": "close"})
        except ConnectionResetError:  # the client went away mid-answer: 499, as for a cancel
            raise
        except Exception as err:  # answered by the errors middleware: logged with its status
            status = 400 if isinstance(err, orjson.JSONEncodeError) else 500
            raise
        finally:
            self._active.discard(task)
            self._cut.discard(task)
            if logged:
                self._log_decision(arrived, self.clock() - started, request_id, summary, route, status,
                                   received)
            if trace is not None:
                trace.end(status)

    def _log_decision(self, arrived: float, duration_s: float, request_id: str,
                      summary: RequestSummary, route: RequestRoute | None, status: int,
                      received: float | None = None) -> None:
        """Queue the request's decision-log line; a fault here never reaches the client."""
        assert self.decision_log is not None
        try:
            placement = route.last if route is not None else None
            fields = request_fields(request_id, placement.summary if placement else summary, placement,
                                    received)
            self.decision_log.write(decision_line(arrived, fields, status, duration_s))
        except Exception:
            log.exception("decision log line for %s failed", request_id)

    async def _attempts(
        self,
        request: Request,
        body: bytes | SplicedBody,
        route: RequestRoute,
        placement: Placement | None,
        request_id: str,
        usage: UsageAccount,
        trace: RequestTrace | None = None,
        decide_ns: int = 0,
    ) -> Answer:
        """Send to each placement in turn (router/placement.py), from the first one (`placement`,
        its slot already reserved; `decide_ns`: when its decision began, for tracing), until a
        replica takes the request; retries only before the first byte reaches the client. What
        each attempt meant for the replica's health and the counters is the placement's to record."""
        assert self.session is not None, "Relay.start() not called"
        headers = end_to_end(request.headers, self._drop, getattr(request, "names", None))
        if self.inject_headers:
            headers.update(self.inject_headers)
        headers[REQUEST_ID] = request_id
        if self.pd is not None:
            return await self.pd.attempts(request, body_bytes(body), route, placement, request_id,
                                          usage, headers, trace, decide_ns)
        last_problem = "no healthy replica"
        path_qs = request.rel_url.raw_path_qs  # as the client encoded it: never decoded on the way
        max_attempts = self.config.max_attempts
        for attempt in range(max_attempts):
            if placement is None:
                break
            current, placement = placement, None
            route.last = current
            status: int | None = None  # the replica's answer, for the upstream span
            try:  # no await since place() or retry(): done() always releases the slot
                if current.home_pending:  # (no coroutine for a request without a session)
                    current.settle_notes()  # (deferred notes are worked out before any await)
                    await current.confirm_home(route.store)
                url = current.url
                if trace is not None:
                    current.settle_notes()
                    trace.decided(current, decide_ns)
                    trace.upstream_start(current, headers)
                sent = current.sent_at = self.clock()
                sent_body = body if current.rank is None else routed_body(body, current.rank)
                try:
                    # Written before `send` returns (on a pooled connection): the decision's
                    # notes (decision log, shadow policies) are worked out while it travels.
                    answer = self.pool.send(request.method, url, path_qs, headers, sent_body)
                    current.settle_notes()
                    upstream = await answer
                except UpstreamConnectError as err:  # the replica never got the request
                    kind = "connect_timeout" if isinstance(err, UpstreamConnectTimeout) else "connect"
                    current.unreachable(kind)
                    last_problem = f"replica {url} unreachable ({kind})"
                    if attempt + 1 < max_attempts:
                        decide_ns = time.time_ns() if trace is not None else 0
                        placement = current.retry()
                    continue
                except UpstreamTimeout as err:  # it got it and may still be working: no retry
                    current.broke(err.kind)
                    return self._timeout_response(url, err, request_id)
                current.answered()
                status = upstream.status
                if upstream.status in self.config.retry_statuses and attempt + 1 < max_attempts:
                    current.refused(upstream.status)
                    last_problem = f"replica {url} answered {upstream.status}"
                    upstream.close()
                    decide_ns = time.time_ns() if trace is not None else 0
                    placement = current.retry()
                    continue
                # Only a request it serves leaves its prompt cached (and reports usage): `_relay`
                # records it once the answer's first bytes are on their way to the client.
                served = 200 <= upstream.status < 300
                usage.placement = current if served else None
                return await self._relay(request, upstream, current, request_id, sent, usage)
            finally:
                current.done()
                if trace is not None:
                    trace.upstream_end(current, status)
        return error_response(
            503,
            f"no replica could take the request: {last_problem}",
            "service_unavailable",
            headers={"Retry-After": "1", REQUEST_ID: request_id},
        )

    async def _relay(
        self,
        request: Request,
        upstream: UpstreamResponse,
        attempt: Placement,
        request_id: str,
        sent: float,
        usage: UsageAccount,
    ) -> Answer:
        url = attempt.url
        served = usage.placement is attempt  # else not served, or a PD prefill's (recorded)
        headers = end_to_end(upstream.headers, self._no_drop, upstream.names)
        headers[REQUEST_ID] = request_id
        if self.replica_header:
            headers[REPLICA_HEADER] = url
            if self.worker_id is not None:
                headers[WORKER_HEADER] = self.worker_id
        sse = upstream.content_type == "text/event-stream"
        try:
            length = upstream.content_length
            whole = not sse and length is not None and length <= _BUFFER_LIMIT
            first: bytes | None = None
            if not sse:
                # Nothing has reached the client yet: a replica failing before its first body
                # bytes gets a clean error status, not a cut connection.
                try:
                    first = upstream.body_now() if whole else None
                    if first is None:
                        first = await (upstream.read() if whole else upstream.readany())
                except UpstreamTimeout as err:
                    attempt.broke(err.kind)
                    return self._timeout_response(url, err, request_id)
                except UpstreamBodyError:
                    attempt.broke("body")
                    return error_response(
                        502, f"replica {url} failed while sending its response", "upstream_error",
                        headers={REQUEST_ID: request_id},
                    )
                self._first_byte(attempt, url, sent, streamed=False)
            if whole:
                if served:
                    attempt.accepted()
                usage.read_body(first)
                return WholeResponse(upstream.status, first, headers)
            return await self._stream(request, upstream, attempt, headers, sse, sent, usage, first)
        finally:
            if served:  # (the stream's first write did it, unless none was made)
                attempt.accepted()
            upstream.close()  # no-op after a full read; otherwise aborts the replica's work

    @staticmethod
    def _timeout_response(url: str, err: UpstreamTimeout, request_id: str) -> web.Response:
        """504 for a replica that timed out before the client got a byte (never retried)."""
        return error_response(504, f"replica {url} timed out: {err}", "upstream_error",
                              headers={REQUEST_ID: request_id})
