"""A lean HTTP/1.1 client for the relay's hot path: keep-alive connections pooled per replica,
each request sent in one write, responses parsed by httptools (llhttp, the parser uvicorn uses)
and handed to the relay as they arrive.

aiohttp's ClientSession spent about a third of the router's CPU on a small proxied request
(tracing hooks, cookie handling, timeout contexts, response and payload objects); the relay
needs none of that. Control-plane calls (polls, /v1/models) keep using aiohttp.

Only what the relay sends is supported: requests with a complete body (Content-Length), no
HEAD, no upgrades. Responses may use Content-Length, chunked encoding or end at close.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import httptools
from multidict import CIMultiDict
from yarl import URL

# A pooled connection idle this long is not reused: below uvicorn's default keep-alive timeout
# (5 s, which SGLang keeps), so the router does not race a replica closing an idle connection.
IDLE_KEEPALIVE_S = 4.0
# Unread response bytes above this pause reading from the replica (TCP back-pressure).
_READ_HIGH_WATER = 1 << 20


class UpstreamError(Exception):
    """The exchange with the replica failed."""


class UpstreamConnectError(UpstreamError):
    """No response started: refused, reset, closed early or garbled. Safe to try elsewhere."""


class UpstreamBodyError(UpstreamError):
    """The response started, then the replica broke off before its end."""


class UpstreamResponse:
    """One response: status and headers now, the body as it arrives (`readany`/`read`).
    `close()` must follow: it returns a finished keep-alive connection to the pool and
    aborts an unfinished one (so the replica stops working on a request nobody reads)."""

    __slots__ = ("status", "headers", "content_length", "content_type", "_conn", "_chunks",
                 "_size", "_done", "_error", "_waiter", "_closed")

    def __init__(self, conn: _Connection, status: int, headers: CIMultiDict[str]) -> None:
        self.status = status
        self.headers = headers
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.content_type = headers.get("Content-Type", "").partition(";")[0].strip().lower()
        self._conn = conn
        self._chunks: list[bytes] = []
        self._size = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    # -- fed by the connection --------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _READ_HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if self._done or self._error is not None:
            return
        if error is None:
            self._done = True
        else:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the relay --------------------------------------------------------------------
    async def readany(self) -> bytes:
        """The bytes received since the last call; b"" at the end. Bytes that arrived before a
        failure are returned first, then the failure is raised."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._size = 0
        self._conn.resume()
        return data

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._done and not self._chunks:
            self._conn.release()
        else:
            self._conn.abort()


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
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._complete = False  # the current response's last byte has arrived
        self._informational = False  # parsing a 1xx response, which precedes the real one
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False

    # -- one exchange -------------------------------------------------------------------------
    async def exchange(self, data: bytes, deadline: float) -> UpstreamResponse:
        assert self.transport is not None and self._response is None
        self.received = 0
        if self.lost or self.transport.is_closing():
            raise UpstreamConnectError("replica closed the connection")
        self._complete = False
        self._head = head = self.loop.create_future()
        self._timer = self.loop.call_at(deadline, self._time_out)
        self.transport.write(data)
        try:
            return await head
        except BaseException:
            self.abort()  # timed out, failed, or the caller was cancelled: the exchange is over
            raise
        finally:
            self._head = None

    def release(self) -> None:
        """The response was read to its end: back to the pool if the replica keeps it open
        (and read our whole request: one that answered early may take leftovers for the next)."""
        self._end_exchange()
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
            self.transport.resume_reading()

    def _fail(self, head_error: BaseException, body_error: BaseException) -> None:
        """End the current exchange with an error: before the headers, or in the body."""
        if self._head is not None and not self._head.done():
            self._head.set_exception(head_error)
        elif self._response is not None and not self._complete:
            self._response._finish(body_error)

    def _time_out(self) -> None:
        self._timer = None
        self._fail(asyncio.TimeoutError(), asyncio.TimeoutError())
        self.lost = True
        if self.transport is not None:
            self.transport.abort()

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
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self._informational = 100 <= status < 200
        if self._informational or self._head is None or self._head.done():
            return
        headers = CIMultiDict(
            (n.decode("latin-1"), v.decode("utf-8", "surrogateescape")) for n, v in self._raw_headers
        )
        self.keep_alive = self.parser.should_keep_alive()
        self._response = UpstreamResponse(self, status, headers)
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
        self._complete = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._response is not None:
            self._response._finish()


def _serialize(method: str, target: str, host: str, headers: CIMultiDict[str], body: bytes) -> bytes:
    fields = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
    head = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n{fields}Content-Length: {len(body)}\r\n\r\n"
    if head.count("\n") != len(headers) + 4 or head.count("\r") != len(headers) + 4:
        raise ValueError("line break in a request header")  # would smuggle a header or a request
    return head.encode("utf-8", "surrogateescape") + body


class UpstreamPool:
    """Keep-alive connections per (scheme, host, port); unlimited, reused most-recent first."""

    def __init__(self, connect_timeout_s: float, total_timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.total_timeout_s = total_timeout_s
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._bases: dict[str, tuple[tuple[str, str, int], str, str]] = {}
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
        return parsed

    async def request(self, method: str, base_url: str, path_qs: str,
                      headers: CIMultiDict[str], body: bytes) -> UpstreamResponse:
        """Send one request to the replica at `base_url`; return once its headers have arrived.
        Raises UpstreamConnectError, or asyncio.TimeoutError (connect or total timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout_s
        key, host, prefix = self._base(base_url)
        data = _serialize(method, prefix + path_qs, host, headers, body)
        conn = self._take_idle(key, loop.time())
        if conn is not None:
            try:
                return await conn.exchange(data, deadline)
            except UpstreamConnectError:
                if conn.received:
                    raise
                # The replica closed this idle connection as we wrote to it: nothing was
                # answered, so the request goes once more on a new connection.
        conn = await self._connect(key, loop, deadline)
        return await conn.exchange(data, deadline)

    def _take_idle(self, key: tuple[str, str, int], now: float) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if (not conn.lost and now - conn.idle_since < IDLE_KEEPALIVE_S
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
        except TimeoutError:
            raise  # an OSError too, but reported as a timeout
        except OSError as err:  # refused, unreachable, DNS, TLS failures (ssl.SSLError is one)
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {err}") from err
        return conn

    def opened(self, conn: _Connection) -> None:
        self._open.add(conn)

    def put_idle(self, conn: _Connection) -> None:
        if self._closed:
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
        for conn in self._idle.pop(key, []):
            conn.abort()
            self._open.discard(conn)
