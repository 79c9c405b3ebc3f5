"""The data port's HTTP/1.1 server: listens, hands each connection to a `Connection`
(router/data_connection.py: requests parsed by httptools from reads into the server's one read
buffer, answers written with one transport write each), dispatches requests to the routes'
handlers inside the middlewares, and writes response heads.

aiohttp's web server spent about a third of the router's CPU on a small proxied request
(request and response objects, middleware wrappers, its payload streams); the data port needs
a handful of fixed routes and none of that. The admin port keeps aiohttp.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from email.utils import formatdate
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from .data_connection import Connection
from .data_limits import READ_BUFFER_BYTES
from .data_http import Answer, Request
from .headers import field_lines

Handler = Callable[[Request], Awaitable[Answer]]
Middleware = Callable[..., Awaitable[Any]]
Lifecycle = Callable[[Any], AsyncIterator[None]]

_REASONS = {s.value: s.phrase for s in __import__("http").HTTPStatus}
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})  # the server's to set
# Bytes of large bodies still to come that may be set aside before they arrive: a head alone
# (its Content-Length, no body yet) must not reserve memory without bound. Past it, bodies are
# parsed as they come, their memory growing with what has arrived.
MAX_AWAITED_BODY_BYTES = 64 << 20


class DataServer:
    """Serves the data port: routes (path -> {method: handler}), middlewares applied around
    every handler (outermost first), and the lifecycle contexts run at start and, in reverse,
    at stop."""

    def __init__(self, routes: dict[str, dict[str, Handler]], middlewares: list[Middleware],
                 lifecycles: list[Lifecycle], *, max_body_bytes: int, header_timeout_s: float,
                 shutdown_grace_s: float) -> None:
        self.routes = routes
        self.middlewares = middlewares
        self.lifecycles = lifecycles
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s = header_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.connections: set[Connection] = set()
        self.stopping = False
        self.loop = asyncio.get_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._running: list[AsyncIterator[None]] = []
        self._date = b""
        self._date_at = 0.0
        self.addresses: list[Any] = []
        # What every connection's socket reads go into (but a large body's, which goes straight
        # into the bytes its handler gets: router/body_bytes.py): parsed, and so copied where
        # kept, before the next read, so one buffer serves them all.
        self.read_buffer = bytearray(READ_BUFFER_BYTES)
        self.read_view = memoryview(self.read_buffer)
        self.awaited_body_bytes = 0  # what is still to come of the large bodies set aside
        # The handler chains, built once: middlewares around each route's handler.
        self._chains: dict[tuple[str, str], Handler] = {}
        for path, methods in routes.items():
            for method, handler in methods.items():
                self._chains[(path, method)] = self._wrap(handler)
        self._unrouted = self._wrap(self._not_routed)

    def _wrap(self, handler: Handler) -> Handler:
        for middleware in reversed(self.middlewares):
            handler = functools.partial(middleware, handler=handler)
        return handler

    def reserve_body(self, size: int) -> bool:
        """Whether a large request body of which `size` bytes are still to come may be set aside
        for now (read straight into a bytes object of its length): not if the bodies awaited
        would pass MAX_AWAITED_BODY_BYTES. If it may, `size` is awaited until `body_arrived`
        says so."""
        if self.awaited_body_bytes + size > MAX_AWAITED_BODY_BYTES:
            return False
        self.awaited_body_bytes += size
        return True

    def body_arrived(self, size: int) -> None:
        """A body `reserve_body` set aside is whole (or will never be): no longer awaited."""
        self.awaited_body_bytes -= size

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        self.loop = asyncio.get_running_loop()
        for lifecycle in self.lifecycles:
            running = lifecycle(self)
            try:
                await running.__anext__()
            except BaseException:
                await self._stop_lifecycles()  # those already started
                raise
            self._running.append(running)
        try:
            self._server = await self.loop.create_server(
                lambda: Connection(self), host, port, backlog=1024, reuse_port=reuse_port or None)
        except BaseException:  # e.g. the port is taken: what started stops
            await self._stop_lifecycles()
            raise
        self.addresses = [s.getsockname() for s in self._server.sockets]
        return int(self.addresses[0][1])

    async def cleanup(self) -> None:
        """Stop: close the listener and the idle connections; requests being served get
        `shutdown_grace_s` to finish, then are cancelled; then the lifecycles stop, in reverse."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.idle:
                conn._close()
        deadline = time.monotonic() + self.shutdown_grace_s
        while any(not c.idle for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        tasks = [c._task for c in self.connections if c._task is not None and not c._task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for conn in list(self.connections):
            conn._close()
        await self._stop_lifecycles()

    async def _stop_lifecycles(self) -> None:
        """The running lifecycles' ends, in reverse: each runs even when one before it raised
        (the first error is raised after all have run; a lifecycle's own error may chain others)."""
        failed: Exception | None = None
        for running in reversed(self._running):
            try:
                await running.__anext__()
            except StopAsyncIteration:
                pass
            except Exception as err:
                failed = failed or err
        self._running.clear()
        if failed is not None:
            raise failed

    async def dispatch(self, request: Request) -> Any:
        method = request.method
        chain = self._chains.get((request.path, "GET" if method == "HEAD" else method))
        return await (chain or self._unrouted)(request)

    async def _not_routed(self, request: Request) -> web.StreamResponse:
        methods = self.routes.get(request.path)
        if methods:
            allowed = sorted(set(methods) | ({"HEAD"} if "GET" in methods else set()))
            raise web.HTTPMethodNotAllowed(request.method, allowed)
        raise web.HTTPNotFound()

    def head(self, status: int, headers: CIMultiDict[str] | CIMultiDictProxy[str], extra: bytes,
             keep_alive: bool, reason: str | None = None) -> bytes:
        """The status line and headers (with Date and Connection), ending in a blank line."""
        now = self.loop.time()
        if now - self._date_at >= 1.0:
            self._date = formatdate(usegmt=True).encode()
            self._date_at = now
        reason = reason or _REASONS.get(status, "")
        # Framing fields are the server's: looked for by name (three case-insensitive lookups
        # cost less than a key view's intersection), so the common answer, with none, is not
        # filtered in Python.
        items = headers.items()
        if "content-length" in headers or "transfer-encoding" in headers or "connection" in headers:
            items = [(n, v) for n, v in items if n.lower() not in _FRAMING]  # type: ignore[assignment]
        head = f"HTTP/1.1 {status} {reason}\r\n{field_lines(items)}"
        # A replica's values are decoded as UTF-8 (undecodable bytes escaped), as aiohttp decodes
        # them: encoded the same way, they are the replica's very bytes (latin-1 would turn a
        # UTF-8 "é" into one byte).
        encoded = head.encode("utf-8", "surrogateescape")
        return b"".join((encoded, b"" if "Date" in headers else b"Date: %b\r\n" % self._date, extra,
                         b"" if keep_alive else b"Connection: close\r\n", b"\r\n"))
