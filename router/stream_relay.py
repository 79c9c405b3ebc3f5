"""Relay a replica's response body to its client as it arrives (the streaming half of
router/relay.py): whole SSE events only, the usage event the router asked for taken out, the
first byte recorded after its write to the client, the last bytes sent with the end, and one
clean error event at an event boundary when the replica fails or times out mid-stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from multidict import CIMultiDict

from ..metrics.router_metrics import RouterMetrics
from .config import UpstreamConfig
from .data_http import Answer, Request, StreamResponse
from .errors import sse_error_event
from .placement import Placement
from .sse_events import EVENT_ENDS, whole_events
from .upstream_errors import UpstreamBodyError, UpstreamTimeout
from .upstream_response import UpstreamResponse
from .usage import OPENAI_ROUTES, UsageAccount, holds_usage_event

log = logging.getLogger("kvrouter.relay")
_BROKEN_BODY = (UpstreamBodyError, UpstreamTimeout)

# Past upstream.total_timeout_s a stream's error event gets this long to reach its client.
_CLIENT_WRITE_GRACE_S = 10.0
# A stream's first event that follows the replica's headers within this long leaves with them in
# one write (one read for the client); past it (the replica prefills) the head goes out alone, and
# the client takes it in (an OpenAI SDK client spends a few hundred us on it) while it waits.
_HEAD_ALONE_AFTER_S = 0.001


def _abort_client(request: Request) -> None:
    transport = request.transport
    if transport is not None and not transport.is_closing():
        log.warning("client of %s stopped reading; connection cut after upstream.total_timeout_s",
                    request.path)
        transport.abort()


class StreamRelay:
    """The part of `router.relay.Relay` that relays one replica response's body to its client
    as it arrives; `Relay` supplies the attributes declared here."""

    config: UpstreamConfig
    clock: Callable[[], float]
    metrics: RouterMetrics
    _cut_reason: str

    def _was_cut(self, task: asyncio.Task[object]) -> bool:
        raise NotImplementedError

    def _first_byte(self, attempt: Placement, url: str, sent: float, *, streamed: bool = True,
                    read_at: float | None = None) -> None:  # read at `read_at` (None: now)
        ttfb = (self.clock() if read_at is None else read_at) - sent
        self.metrics.observe(self.metrics.upstream_ttfb, (url,), ttfb)
        attempt.first_byte(ttfb, streamed)

    @staticmethod
    async def _end_with_error(
        request: Request, response: StreamResponse, sse: bool, message: str, code: int = 502
    ) -> Answer:
        if sse:
            await response.write(sse_error_event(message, code))
            await response.write_eof()
        elif request.transport is not None:
            # A plain body cannot carry an error, and a clean end would pass a truncated
            # body off as complete: abort the connection so the client sees the failure.
            request.transport.abort()
        return response

    async def _stream(
        self,
        request: Request,
        upstream: UpstreamResponse,
        attempt: Placement,
        headers: CIMultiDict[str],
        sse: bool,
        sent: float,
        usage: UsageAccount,
        first: bytes | None,
    ) -> Answer:
        response = StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)  # headers are buffered until the first body write
        loop = request._conn.loop  # (the running loop: no getpid() to find it)
        # ... or until _HEAD_ALONE_AFTER_S has passed with no event from the replica
        head_alone = (loop.call_later(_HEAD_ALONE_AFTER_S, response.send_head)
                      if sse and upstream.waiting else None)
        # A client that stops reading blocks our writes, and with them the upstream's timeouts
        # (reading from the replica pauses): past the total timeout plus a grace for the error
        # event, its connection is cut, so the blocked write fails and the slot is released.
        watchdog = loop.call_later(
            max(0.0, self.config.total_timeout_s + _CLIENT_WRITE_GRACE_S - (self.clock() - sent)),
            _abort_client, request)
        try:
            return await self._relay_body(request, response, upstream, attempt, sse, sent, usage, first)
        finally:
            watchdog.cancel()
            if head_alone is not None:
                head_alone.cancel()

    async def _relay_body(
        self,
        request: Request,
        response: StreamResponse,
        upstream: UpstreamResponse,
        attempt: Placement,
        sse: bool,
        sent: float,
        usage: UsageAccount,
        first: bytes | None,
    ) -> Answer:
        """Relays the body; `first` is its first chunk when already read (plain bodies)."""
        url = attempt.url
        write = response.write
        readany = upstream.readany
        tail = bytearray()  # SSE: bytes after the last complete event, not yet sent
        max_tail = self.config.max_sse_event_bytes
        # Usage: an OpenAI stream's usage-only event is found by one substring search of each
        # whole-event write (taken out if the router asked for it); a /generate stream's final
        # meta_info is read once at its end from the last two writes (kept by reference).
        watch = sse and usage.placement is not None and usage.route in OPENAI_ROUTES
        keep_last = sse and usage.placement is not None and usage.route == "/generate"
        before = last = b""
        # A long prompt's record in the KV index costs up to milliseconds: not in the time to
        # first token. It is made while the replica prefills, or after the first write if the
        # first bytes came with the head.
        accept = attempt.accepted if usage.placement is attempt else None
        held = b""  # the body's last bytes, once the replica has sent its end: they go out
        # with the response's end (the empty chunk) in one write, not two
        # When the first bytes were read: recorded (TTFB metric, Placement.first_byte) after
        # their write to the client, not in its time to first byte; recorded whatever happens.
        first_at: float | None = None
        ended = False
        try:
            if first is None:
                if accept is not None:  # runs once this read waits (a request sharing the prefix
                    # may be placed meanwhile); a no-op if the first write recorded it already
                    request._conn.loop.call_soon(accept)
                chunk = await readany()
                first_at = self.clock()
            else:
                chunk = first
            while chunk:
                if not sse:
                    out = chunk
                elif not tail and chunk.endswith(EVENT_ENDS):
                    # the common case: whole events, relayed as they are
                    if watch and holds_usage_event(chunk):
                        chunk = usage.take_event(chunk)
                    elif keep_last:
                        before, last = last, chunk
                    out = chunk
                else:  # whole events only (router/sse_events.py)
                    out, tail = whole_events(tail, chunk)
                    if out:
                        if watch and holds_usage_event(out):
                            out = usage.take_event(out)
                        elif keep_last:
                            before, last = last, out
                    if len(tail) > max_tail:  # an event that never ends must not grow memory
                        if out:
                            await write(out)
                        attempt.broke("sse_event_too_large")
                        return await self._end_with_error(
                            request, response, sse, f"replica {url} sent an SSE event larger than "
                            f"upstream.max_sse_event_bytes ({max_tail} bytes)")
                if upstream.at_eof:
                    held = out
                    break
                if out:
                    await write(out)
                    if first_at is not None:
                        self._first_byte(attempt, url, sent, read_at=first_at)
                        first_at = None
                    if accept is not None:
                        accept()
                        accept = None
                chunk = await readany()
            ended = True  # the replica's end came: its last bytes and the end go out below
        except _BROKEN_BODY as err:  # only reads from the replica raise these (writes to a
            # client that went away raise ConnectionResetError, which propagates)
            if isinstance(err, UpstreamTimeout):
                attempt.broke(err.kind)
                return await self._end_with_error(request, response, sse, f"replica {url} timed out: {err}", 504)
            attempt.broke("midstream")
            return await self._end_with_error(request, response, sse, f"replica {url} failed mid-stream")
        except asyncio.CancelledError:
            task = asyncio.current_task(request._conn.loop)
            if task is None or not self._was_cut(task):
                raise  # the client went away, or something else cancels this handler
            return await self._end_with_error(request, response, sse, self._cut_reason, 503)
        finally:
            if first_at is not None and not ended:  # no write made it out: recorded all the same
                self._first_byte(attempt, url, sent, read_at=first_at)
        if tail:
            held += tail
        try:
            await response.write_eof(held)
        finally:
            if first_at is not None:  # the whole body went out with the end
                self._first_byte(attempt, url, sent, read_at=first_at)
            if accept is not None:  # nothing went out before the end: recorded before its usage is learnt
                accept()
            usage.stream_ended(sse, before + last if keep_last else b"")
        return response
