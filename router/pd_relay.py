"""Move bytes for a prefill/decode-disaggregated fleet (SGLang's PD protocol).

Each attempt sends the request to one prefill server (the policy's placement) and one decode
server (`DecodePool`) at once, with ``bootstrap_host`` (the prefill server's host),
``bootstrap_port`` (its bootstrap port) and ``bootstrap_room`` (random, 63 bits) added to the
body, as SGLang's disaggregation expects. The prefill server's answer is read and discarded;
the decode server's is relayed to the client like any replica's answer (`Relay._relay`). The
usage the decode server reports goes to the prefill placement: the prompt's cache lives there.

Before a byte reaches the client, a failed half is retried on another pair: a prefill server
that is unreachable or answers a retryable status, a decode server that is unreachable or
answers 5xx (it could not get its KV). The other half is aborted (its connection closed). Every
pair that fails after both halves were sent counts in ``kvrouter_pd_bootstrap_failures_total``.
A 4xx from either half is the client's error: relayed as it is, not retried.

With tracing on, each attempt gets the plain path's decision span and one upstream span per half
(`router/tracing.py`), and each server gets its own span's context as `traceparent`. A retry on
the same prefill server (`Placement.again`) keeps the decision's notes and counts the prompt once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from yarl import URL

from .config import DisaggregationConfig
from .data_http import Answer, Request
from .decode_pool import DecodePool, DecodeSlot
from .errors import error_response
from .headers import REQUEST_ID
from .placement import Placement, RequestRoute
from .ranks import room_for_rank
from .upstream_errors import UpstreamConnectError, UpstreamConnectTimeout, UpstreamTimeout
from .upstream_response import UpstreamResponse
from .usage import UsageAccount

if TYPE_CHECKING:
    from multidict import CIMultiDict

    from .relay import Relay
    from .tracing import RequestTrace

log = logging.getLogger("kvrouter.relay")
ROOM_BITS = 63  # SGLang's rooms: random.randint(0, 2**63 - 1) in its own load balancer


def bootstrap_body(parsed: dict[str, Any], prefill_url: str, bootstrap_port: int, room: int,
                   routed_dp_rank: int | None = None) -> bytes:
    """A half's request body: the client's, with the three bootstrap fields set (and the
    prefill half's DP rank, when the router chose one)."""
    host = URL(prefill_url).host
    fields: dict[str, Any] = {"bootstrap_host": host, "bootstrap_port": bootstrap_port,
                              "bootstrap_room": room}
    if routed_dp_rank is not None:
        fields["routed_dp_rank"] = routed_dp_rank
    return orjson.dumps({**parsed, **fields})


def _discard(task: asyncio.Task[UpstreamResponse]) -> None:
    """The other half of a failed pair: cancel its exchange, or close the response it got."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        task.result().close()
    task.add_done_callback(_close_late)


def _close_late(task: asyncio.Task[UpstreamResponse]) -> None:
    """A discarded half that still ended with a response: close it (and retrieve any error)."""
    if not task.cancelled() and task.exception() is None:
        task.result().close()


async def _drain(response: UpstreamResponse, url: str,
                 ended: Callable[[str | None], None] | None = None) -> None:
    """Read the prefill server's answer to its end (nobody needs it), then free the connection;
    `ended` is told why the exchange failed (None: it did not)."""
    error: str | None = None
    try:
        await response.read()
    except Exception as err:  # noqa: BLE001 - its decode half reports what the client sees
        error = "midstream"
        log.info("prefill server %s broke off its answer: %r", url, err)
    finally:
        response.close()
        if ended is not None:
            ended(error)


class _PairSpans:
    """One attempt's two upstream spans (tracing on): each half's context goes into its own
    copy of the headers. The prefill half's span ends when its answer is drained, the decode
    half's when the client's answer is over; `end` ends whatever is still open."""

    __slots__ = ("prefill", "decode", "placement", "slot", "prefill_status", "prefill_head_s")

    def __init__(self, trace: RequestTrace, prefill: Placement, decode: DecodeSlot, room: int,
                 p_headers: CIMultiDict[str], d_headers: CIMultiDict[str]) -> None:
        attempt = len(prefill.tried) + 1
        self.prefill = trace.exchange(prefill.url, attempt, p_headers, pd_role="prefill", bootstrap_room=room)
        self.decode = trace.exchange(decode.url, attempt, d_headers, pd_role="decode", bootstrap_room=room)
        self.placement, self.slot = prefill, decode
        self.prefill_status: int | None = None
        self.prefill_head_s: float | None = None  # send to the prefill server's response head

    def prefill_ended(self, error: str | None = None) -> None:
        self.prefill.end(self.prefill_status, self.prefill_head_s, None, error or self.placement.error)

    def end(self) -> None:
        self.prefill_ended()
        slot = self.slot  # the answer's usage is recorded on the prefill placement
        self.decode.end(slot.status, slot.ttfb_s, self.placement.usage, slot.error)


class PDForwarder:
    """The attempts of one router's disaggregated requests (one per router, like the relay)."""

    def __init__(self, relay: Relay, decode: DecodePool, config: DisaggregationConfig,
                 rng: random.Random | None = None, dp_size: int = 1) -> None:
        self.relay = relay
        self.dp_size = dp_size  # the prefill servers' DP-attention ranks
        self.decode = decode
        self.config = config
        self.discovered_ports: dict[str, int] = {}  # discovered prefill servers' bootstrap ports
        self.rng = rng or random.SystemRandom()

    def bootstrap_port(self, url: str) -> int:
        """Prefill server `url`'s bootstrap port: the config's for a listed server, else what
        discovery found, else SGLang's default."""
        if any(p.url == url for p in self.config.prefill) or url not in self.discovered_ports:
            return self.config.bootstrap_port(url)
        return self.discovered_ports[url]

    async def attempts(
        self,
        request: Request,
        body: bytes,
        route: RequestRoute,
        placement: Placement | None,
        request_id: str,
        usage: UsageAccount,
        headers: CIMultiDict[str],
        trace: RequestTrace | None = None,
        decide_ns: int = 0,
    ) -> Answer:
        """Send `placement` (its slot already reserved; None: no prefill server) and a decode
        server the request at once, retrying on another pair before the first byte. `trace`:
        the request's spans (`decide_ns`: when the first decision began)."""
        relay = self.relay
        m = relay.metrics
        parsed = orjson.loads(body)  # the handler parsed it once: a JSON object
        path_qs = request.rel_url.raw_path_qs
        last_problem = "no healthy prefill server"
        decode_tried: frozenset[str] = frozenset()
        for attempt in range(relay.config.max_attempts):
            if placement is None:
                break
            prefill, placement = placement, None
            route.last = prefill  # what the decision log reports
            decode = self.decode.place(decode_tried, prefill.summary.prompt_tokens)
            if decode is None:
                prefill.done()
                last_problem = "no healthy decode server"
                break
            decode.paired = prefill
            prefill.decode = decode
            last = attempt + 1 >= relay.config.max_attempts
            drain: asyncio.Task[None] | None = None
            spans: _PairSpans | None = None
            try:
                await prefill.confirm_home(route.store)
                room = self.rng.getrandbits(ROOM_BITS)
                port = self.bootstrap_port(prefill.url)
                if prefill.rank is not None:  # the decode side finds the KV on rank room % dp
                    room = room_for_rank(room, prefill.rank, self.dp_size)
                # routed_dp_rank names the prefill server's rank; the decode server picks its own
                p_body = bootstrap_body(parsed, prefill.url, port, room, prefill.rank)
                d_body = bootstrap_body(parsed, prefill.url, port, room)
                p_headers = d_headers = headers
                if trace is not None:
                    trace.decided(prefill, decide_ns)
                    p_headers, d_headers = headers.copy(), headers.copy()
                    spans = _PairSpans(trace, prefill, decode, room, p_headers, d_headers)
                sent = relay.clock()
                p_task = asyncio.ensure_future(
                    relay.pool.request(request.method, prefill.url, path_qs, p_headers, p_body))
                d_task = asyncio.ensure_future(
                    relay.pool.request(request.method, decode.url, path_qs, d_headers, d_body))
                try:
                    p_resp = await p_task
                except UpstreamConnectError as err:
                    _discard(d_task)
                    kind = "connect_timeout" if isinstance(err, UpstreamConnectTimeout) else "connect"
                    prefill.unreachable(kind)
                    m.child(m.pd_bootstrap_failures, "prefill").inc()
                    last_problem = f"prefill server {prefill.url} unreachable ({kind})"
                    decide_ns = time.time_ns()  # the retry's decision (a span's start)
                    placement = None if last else prefill.retry()
                    continue
                except UpstreamTimeout as err:
                    _discard(d_task)
                    prefill.broke(err.kind)
                    return relay._timeout_response(prefill.url, err, request_id)
                except BaseException:
                    _discard(d_task)
                    raise
                prefill.answered()
                if spans is not None:
                    spans.prefill_status, spans.prefill_head_s = p_resp.status, relay.clock() - sent
                if not 200 <= p_resp.status < 300:
                    _discard(d_task)
                    retryable = p_resp.status in relay.config.retry_statuses
                    if retryable or p_resp.status >= 500:  # a 4xx is the client's, not the pair's
                        m.child(m.pd_bootstrap_failures, "prefill").inc()
                    if retryable and not last:
                        prefill.refused(p_resp.status)
                        p_resp.close()
                        last_problem = f"prefill server {prefill.url} answered {p_resp.status}"
                        decide_ns = time.time_ns()
                        placement = prefill.retry()
                        continue
                    usage.placement = None
                    return await relay._relay(request, p_resp, prefill, request_id, sent, usage)
                prefill.accepted()  # it computed the prompt's KV: its cache holds the prefix now
                drain = asyncio.ensure_future(
                    _drain(p_resp, prefill.url, spans.prefill_ended if spans is not None else None))
                result = await self._decode_half(request, d_task, decode, prefill, request_id, sent, usage, last)
                if isinstance(result, str):
                    last_problem = result
                    decode_tried |= {decode.url}
                    decide_ns = time.time_ns()
                    placement = prefill.again() or prefill.retry()
                    continue
                return result
            finally:
                if drain is not None and not drain.done():
                    drain.cancel()  # the request is over: its prefill half too
                # a prefill half whose decode half did not answer 2xx served nothing
                prefill.done(served=decode.status is not None and 200 <= decode.status < 300)
                decode.done()
                if spans is not None:
                    spans.end()
        return error_response(
            503, f"no prefill/decode pair could take the request: {last_problem}",
            "service_unavailable", headers={"Retry-After": "1", REQUEST_ID: request_id},
        )

    async def _decode_half(
        self,
        request: Request,
        d_task: asyncio.Task[UpstreamResponse],
        decode: DecodeSlot,
        prefill: Placement,
        request_id: str,
        sent: float,
        usage: UsageAccount,
        last: bool,
    ) -> Answer | str:
        """Relay the decode server's answer; a string (the problem) when the pair is retried."""
        relay, m = self.relay, self.relay.metrics
        try:
            d_resp = await d_task
        except UpstreamConnectError as err:
            kind = "connect_timeout" if isinstance(err, UpstreamConnectTimeout) else "connect"
            decode.unreachable(kind)
            m.child(m.pd_bootstrap_failures, "decode").inc()
            problem = f"decode server {decode.url} unreachable ({kind})"
            if last:
                return error_response(503, f"no prefill/decode pair could take the request: {problem}",
                                      "service_unavailable",
                                      headers={"Retry-After": "1", REQUEST_ID: request_id})
            return problem
        except UpstreamTimeout as err:
            decode.broke(err.kind)
            return relay._timeout_response(decode.url, err, request_id)
        decode.answered()
        decode.status = d_resp.status
        if d_resp.status >= 500:
            m.child(m.pd_bootstrap_failures, "decode").inc()
            if not last:
                decode.refused(d_resp.status)
                with contextlib.suppress(Exception):
                    d_resp.close()
                return f"decode server {decode.url} answered {d_resp.status}"
        served = 200 <= d_resp.status < 300
        usage.placement = prefill if served else None  # the prompt's cache is the prefill side's
        return await relay._relay(request, d_resp, decode, request_id, sent, usage)  # type: ignore[arg-type]
