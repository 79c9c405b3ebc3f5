"""A lean HTTP/1.1 client for the relay's hot path (and the poller's scrapes): keep-alive
connections pooled per replica, each request sent in one write, responses parsed by httptools
(llhttp, the parser uvicorn uses) and handed to the relay as they arrive.

aiohttp's ClientSession spent about a third of the router's CPU on a small proxied request
(tracing hooks, cookie handling, timeout contexts, response and payload objects); the relay
needs none of that, nor does a scrape. /v1/models keeps using aiohttp.

Only what the relay sends is supported: requests with a complete body (Content-Length), no
HEAD, no upgrades. Responses may use Content-Length, chunked encoding or end at close.

Timeouts: connect (UpstreamConnectTimeout, safe to retry), then per exchange one timer for the
headers (header and total deadlines) and the body (idle gap between bytes, total deadline).
data_received only records the time of the last byte; the timer checks it when it fires and
sleeps again until the next deadline, so streaming costs no timer work per chunk.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Coroutine
from typing import Any

import httptools
from multidict import CIMultiDict
from yarl import URL

from .headers import field_lines
from .json_splice import SplicedBody
from .upstream_response import UpstreamResponse as UpstreamResponse
from .upstream_errors import (
    UpstreamBodyError as UpstreamBodyError,
    UpstreamConnectError as UpstreamConnectError,
    UpstreamConnectTimeout as UpstreamConnectTimeout,
    UpstreamError as UpstreamError,
    UpstreamTimeout as UpstreamTimeout,
)

# A pooled connection idle this long is not reused: below uvicorn's default keep-alive timeout
# (5 s, which SGLang keeps), so the router does not race a replica closing an idle connection.
IDLE_KEEPALIVE_S = 4.0
# A request body this large goes out behind its head in one vectored write instead of being
# copied behind it; below it the copy is cheaper than the vectored write's bookkeeping.
_VECTORED_BODY_BYTES = 64 * 1024


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica; one exchange at a time."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.keep_alive = False
        self.idle_since = 0.0
        self.received = 0  # bytes of the current exchange's response so far
        self._raw_headers: list[bytes] = []  # name, value, name, value, ...
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._complete = False  # the current response's last byte has arrived
        self._informational = False  # parsing a 1xx response, which precedes the real one
        self._timer: asyncio.TimerHandle | None = None  # the exchange's deadline check
        self._clock = loop.time
        self._last_byte = 0.0  # loop time the last byte (or the request) went by
        self._head_at = 0.0  # the headers are due by then (header or total deadline)
        self._total_at = 0.0  # the whole exchange is due by then
        self._paused = False

    # -- one exchange -------------------------------------------------------------------------
    async def exchange(self, data: bytes | tuple[bytes | memoryview, ...],
                       deadline: float) -> UpstreamResponse:
        """Send `data`; return once the response headers arrive. `deadline` (loop time) ends the
        whole exchange; the pool's header and idle timeouts count from now."""
        return await self.head_of(self.send(data, deadline))

    def send(self, data: bytes | tuple[bytes | memoryview, ...],
             deadline: float) -> asyncio.Future[UpstreamResponse]:
        """`exchange`'s first half: write `data` now; the future the headers resolve, which
        `head_of` must await next."""
        assert self.transport is not None and self._response is None
        self.received = 0
        if self.lost or self.transport.is_closing():
            raise UpstreamConnectError("replica closed the connection")
        self._complete = False
        self._head = head = self.loop.create_future()
        now = self._last_byte = self._clock()
        self._total_at = deadline
        self._head_at = min(now + self.pool.header_timeout_s, deadline)
        # The first check comes no later than any deadline the body could have (they all count
        # from a later byte), so the timer is never re-armed when the headers come quickly. A
        # keep-alive connection's timer outlives its exchanges: one due no later is kept (when
        # it fires it sleeps until the current exchange's next deadline), not made anew.
        due = min(self._head_at, now + self.pool.idle_timeout_s)
        timer = self._timer
        if timer is None or timer.when() > due:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(due, self._check_deadlines)
        if isinstance(data, tuple):
            self.transport.writelines(data)
        else:
            self.transport.write(data)
        return head

    async def head_of(self, head: asyncio.Future[UpstreamResponse]) -> UpstreamResponse:
        """`exchange`'s second half: the response once its headers arrive (`head`, from `send`)."""
        try:
            return await head
        except BaseException:
            self.abort()  # timed out, failed, or the caller was cancelled: the exchange is over
            raise
        finally:
            self._head = None

    def release(self) -> None:
        """The response was read to its end: back to the pool if the replica keeps it open
        (and read our whole request: one that answered early may take leftovers for the next).
        A pooled connection keeps its deadline timer for its next exchange."""
        self._response = None
        if (self.keep_alive and not self.lost and not self._paused and self.transport is not None
                and not self.transport.get_write_buffer_size()):
            self.pool.put_idle(self)
        else:
            self.abort()

    def abort(self) -> None:
        why = "connection to the replica closed by the router"
        self._fail(UpstreamConnectError(why), UpstreamBodyError(why))  # nobody waits forever
        self._end_exchange()
        self.lost = True
        if self.transport is not None:
            self.transport.abort()

    def _end_exchange(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._response = None

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self._last_byte = self._clock()  # the silence while paused was ours, not the replica's
            self.transport.resume_reading()

    def _fail(self, head_error: BaseException, body_error: BaseException) -> None:
        """End the current exchange with an error: before the headers, or in the body."""
        if self._head is not None and not self._head.done():
            self._head.set_exception(head_error)
        elif self._response is not None and not self._complete:
            self._response._finish(body_error)

    def _check_deadlines(self) -> None:
        """The exchange's one timer: time it out if a deadline has passed, else sleep until the
        next one (bytes that came meanwhile moved the idle deadline on). Between exchanges, or
        once the response has ended, nothing is due: the timer ends."""
        self._timer = None
        if self.lost or self._head is None and (self._response is None or self._complete):
            return
        now = self._clock()
        if self._response is None:  # waiting for the headers
            if now >= self._head_at:
                self._time_out("total_timeout" if self._head_at >= self._total_at else "header_timeout")
                return
            due = self._head_at
        else:
            if now >= self._total_at:
                self._time_out("total_timeout")
                return
            # While reading is paused (the client reads slowly) the replica cannot be idle.
            idle_at = (now if self._paused else self._last_byte) + self.pool.idle_timeout_s
            if now >= idle_at:
                self._time_out("idle_timeout")
                return
            due = min(idle_at, self._total_at)
        self._timer = self.loop.call_at(due, self._check_deadlines)

    def _time_out(self, kind: str) -> None:
        error = UpstreamTimeout(kind, self.pool.timeout_message(kind))
        self._fail(error, error)
        self.lost = True
        if self.transport is not None:
            self.transport.abort()  # the replica sees the disconnect and aborts the request

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.pool.opened(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._head is None and self._response is None:
            self.abort()  # bytes nobody asked for: this connection cannot be trusted again
            self.pool.forget(self)
            return
        self.received += len(data)
        self._last_byte = self._clock()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as err:  # 101: never asked for
            self._fail(UpstreamConnectError(f"bad response: {err}"),
                       UpstreamBodyError(f"bad response body: {err}"))
            self.abort()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        if self._timer is not None:  # nothing is due on a closed connection: let it go now
            self._timer.cancel()
            self._timer = None
        response = self._response
        if (exc is None and response is not None and not self._complete
                and response.content_length is None
                and "chunked" not in response.headers.get("Transfer-Encoding", "").lower()):
            self._complete = True  # a body delimited by the connection's end is now complete
            response._finish()
            return
        why = "replica closed the connection" if exc is None else f"connection lost: {exc}"
        self._fail(UpstreamConnectError(why), UpstreamBodyError(why))

    # -- httptools callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._complete:
            self.keep_alive = False  # a second response nobody asked for: never reuse this one
        self._raw_headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        raw = self._raw_headers
        raw.append(name)
        raw.append(value)

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self._informational = 100 <= status < 200
        if self._informational or self._head is None or self._head.done():
            return
        raw = self._raw_headers
        # Names and values decoded in a few calls, not two per field: split at the line feeds
        # none of them holds (a value folded over lines does: then each is decoded on its own).
        raw_names = raw[::2]
        names = b"\n".join(raw_names).decode("latin-1")
        values = b"\n".join(raw[1::2]).decode("utf-8", "surrogateescape").split("\n")
        if len(values) != len(raw_names):
            values = [v.decode("utf-8", "surrogateescape") for v in raw[1::2]]
        headers = CIMultiDict(zip(names.split("\n"), values)) if raw else CIMultiDict()
        self.keep_alive = self.parser.should_keep_alive()
        self._response = UpstreamResponse(self, status, headers,
                                          frozenset(names.lower().split("\n")) if raw else frozenset())
        idle_at = self._last_byte + self.pool.idle_timeout_s
        if self._timer is not None and self._timer.when() > idle_at:  # slow headers: check sooner
            self._timer.cancel()
            self._timer = self.loop.call_at(min(idle_at, self._total_at), self._check_deadlines)
        self._head.set_result(self._response)

    def on_body(self, body: bytes) -> None:
        if self._response is not None and not self._informational and not self._complete:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if self._complete:
            return  # the end of an unasked-for response (see on_message_begin)
        self._complete = True  # nothing more is due: the timer, when it fires, ends
        if self._response is not None:
            self._response._finish()


def _serialize(method: str, target: str, host: str, headers: CIMultiDict[str],
               body: bytes | SplicedBody) -> bytes | tuple[bytes | memoryview, ...]:
    """The request's bytes: one string, or for a large body the head and the body's pieces,
    written together by one vectored write (no copy of the body behind its head)."""
    fields = field_lines(headers.items())
    # A GET without a body (the poller's scrapes) says nothing of one (RFC 9110, 8.6).
    length = "" if method == "GET" and not len(body) else f"Content-Length: {len(body)}\r\n"
    head = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n{fields}{length}\r\n"
    lines = len(headers) + (4 if length else 3)
    if head.count("\n") != lines or head.count("\r") != lines:
        raise ValueError("line break in a request header")  # would smuggle a header or a request
    try:  # the client's fields, decoded as latin-1 by the data port: their very bytes
        encoded = head.encode("latin-1")
    except UnicodeEncodeError:  # a configured value beyond latin-1
        encoded = head.encode("utf-8", "surrogateescape")
    pieces = (body,) if isinstance(body, bytes) else body.pieces
    return (encoded, *pieces) if len(body) >= _VECTORED_BODY_BYTES else b"".join((encoded, *pieces))


class UpstreamPool:
    """Keep-alive connections per (scheme, host, port); unlimited, reused most-recent first.
    `header_timeout_s` and `idle_timeout_s` default to the total (no tighter limit)."""

    def __init__(self, connect_timeout_s: float, total_timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None, *,
                 header_timeout_s: float | None = None, idle_timeout_s: float | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.total_timeout_s = total_timeout_s
        self.header_timeout_s = total_timeout_s if header_timeout_s is None else header_timeout_s
        self.idle_timeout_s = total_timeout_s if idle_timeout_s is None else idle_timeout_s
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._bases: dict[str, tuple[tuple[str, str, int], str, str]] = {}
        # Keys of replicas that left: a connection that finishes its exchange after the removal
        # is closed, not pooled (cleared when a request to that host and port is sent again).
        self._gone: set[tuple[str, str, int]] = set()
        self._closed = False

    def _base(self, base_url: str) -> tuple[tuple[str, str, int], str, str]:
        """(pool key, Host header, path prefix) of a replica URL, parsed once."""
        parsed = self._bases.get(base_url)
        if parsed is None:
            url = URL(base_url)
            assert url.raw_host is not None and url.port is not None, base_url
            name = f"[{url.raw_host}]" if ":" in url.raw_host else url.raw_host  # IPv6; IDNA encoded
            host = name if url.is_default_port() else f"{name}:{url.port}"
            parsed = ((url.scheme, url.raw_host, url.port), host, url.raw_path.rstrip("/"))
            self._bases[base_url] = parsed
            self._gone.discard(parsed[0])
        return parsed

    def timeout_message(self, kind: str) -> str:
        if kind == "header_timeout":
            return f"no response headers within upstream.header_timeout_s ({self.header_timeout_s:g} s)"
        if kind == "idle_timeout":
            return f"no response bytes for upstream.idle_timeout_s ({self.idle_timeout_s:g} s)"
        return f"exchange not finished within upstream.total_timeout_s ({self.total_timeout_s:g} s)"

    async def request(self, method: str, base_url: str, path_qs: str,
                      headers: CIMultiDict[str], body: bytes | SplicedBody) -> UpstreamResponse:
        """Send one request to the replica at `base_url`; return once its headers have arrived.
        Raises UpstreamConnectError (UpstreamConnectTimeout among them: nothing was sent), or
        UpstreamTimeout (header or total timeout: the replica has the request)."""
        return await self.send(method, base_url, path_qs, headers, body)

    def send(self, method: str, base_url: str, path_qs: str, headers: CIMultiDict[str],
             body: bytes | SplicedBody) -> Coroutine[Any, Any, UpstreamResponse]:
        """`request`, whose bytes are written before this returns when a pooled connection
        takes them: the caller can do its own work while they travel, before awaiting the
        returned coroutine (which it must, at once: the exchange is under way). Without a
        pooled connection, the coroutine connects and sends when awaited."""
        key, host, prefix = self._base(base_url)
        data = _serialize(method, prefix + path_qs, host, headers, body)
        conn = self._take_idle(key)
        if conn is None:
            return self._send_on_new(key, data, asyncio.get_running_loop())
        # A pooled connection's loop is the running one (asking asyncio for it costs a
        # getpid() system call)
        deadline = conn.loop.time() + self.total_timeout_s
        try:
            head = conn.send(data, deadline)
        except UpstreamConnectError:  # closed while idle: nothing was sent on it
            return self._send_on_new(key, data, conn.loop)
        return self._head_or_resend(conn, head, key, data, deadline)

    async def _head_or_resend(self, conn: _Connection, head: asyncio.Future[UpstreamResponse],
                              key: tuple[str, str, int], data: bytes | tuple[bytes | memoryview, ...],
                              deadline: float) -> UpstreamResponse:
        try:
            return await conn.head_of(head)
        except UpstreamConnectError:
            if conn.received:
                raise
            # The replica closed this idle connection as we wrote to it: nothing was
            # answered, so the request goes once more on a new connection.
        new = await self._connect(key, conn.loop, deadline)
        return await new.exchange(data, deadline)

    async def _send_on_new(self, key: tuple[str, str, int], data: bytes | tuple[bytes | memoryview, ...],
                           loop: asyncio.AbstractEventLoop) -> UpstreamResponse:
        deadline = loop.time() + self.total_timeout_s
        conn = await self._connect(key, loop, deadline)
        return await conn.exchange(data, deadline)

    def _take_idle(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if (not conn.lost and conn.loop.time() - conn.idle_since < IDLE_KEEPALIVE_S
                    and conn.transport is not None and not conn.transport.is_closing()):
                return conn
            conn.abort()
            self._open.discard(conn)
        return None

    async def _connect(self, key: tuple[str, str, int], loop: asyncio.AbstractEventLoop,
                       deadline: float) -> _Connection:
        if self._closed:
            raise UpstreamConnectError("router is closing")
        scheme, host, port = key
        context = None
        if scheme == "https":
            if self._ssl is None:  # built once: each build reads the trust store (~20 ms)
                self._ssl = ssl.create_default_context()
            context = self._ssl
        conn = _Connection(self, key, loop)
        timeout = min(self.connect_timeout_s, max(0.0, deadline - loop.time()))
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(lambda: conn, host, port, ssl=context,
                                             server_hostname=host if context else None)
        except TimeoutError:  # an OSError too, but reported as a timeout
            raise UpstreamConnectTimeout(
                f"cannot connect to {host}:{port} within {timeout:g} s (upstream.connect_timeout_s)") from None
        except OSError as err:  # refused, unreachable, DNS, TLS failures (ssl.SSLError is one)
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {err}") from err
        return conn

    def opened(self, conn: _Connection) -> None:
        self._open.add(conn)

    def put_idle(self, conn: _Connection) -> None:
        if self._closed or conn.key in self._gone:
            conn.abort()
            return
        conn.idle_since = conn.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: _Connection) -> None:
        """`conn` is gone: never hand it out again."""
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        if conn.key in self._gone and not any(c.key == conn.key for c in self._open):
            self._gone.discard(conn.key)  # its replica's last connection: nothing left to close

    def connections(self) -> list[asyncio.Transport]:
        """The open connections' transports (tests check their socket options)."""
        return [c.transport for c in self._open if c.transport is not None and not c.lost]

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
        self._open.clear()

    def forget_replica(self, base_url: str) -> None:
        """`base_url` left the fleet: close its idle connections and drop its parsed URL.
        Connections still carrying a request finish it; another replica URL on the same
        host and port keeps the shared idle connections."""
        parsed = self._bases.pop(base_url, None)
        if parsed is None:
            return
        key = parsed[0]
        if any(other[0] == key for other in self._bases.values()):
            return
        self._gone.add(key)
        for conn in self._idle.pop(key, []):
            conn.abort()
            self._open.discard(conn)
