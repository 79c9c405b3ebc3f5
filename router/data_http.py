"""The data port's request and streamed-response objects (router/data_server.py serves them).

A `Request` carries what the handlers read: method, path (decoded), the target as the client
encoded it (`rel_url.raw_path_qs`), headers, and its body as it arrives. A `StreamResponse` is
written as it goes; whole answers are aiohttp `web.Response` values (the admin API shares the
error helpers that build them) or, for a replica's relayed answer, a `WholeResponse`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Set as AbstractSet
from typing import TYPE_CHECKING, Union

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

if TYPE_CHECKING:
    from .data_connection import Connection

Answer = Union[web.StreamResponse, "StreamResponse", "WholeResponse"]  # what a data-port handler returns


class WholeResponse:
    """A whole answer the relay already holds (status, headers, body): what `web.Response`
    is to the data port, without its construction cost (about 10 us: content-type and
    charset handling the relayed headers do not need). Written in one write like it."""

    __slots__ = ("status", "headers", "body", "reason", "keep_alive")

    def __init__(self, status: int, body: bytes, headers: CIMultiDict[str]) -> None:
        self.status = status
        self.body = body
        self.headers = headers
        self.reason: str | None = None
        self.keep_alive: bool | None = None


class Request:
    """One request: method, path (decoded), headers, and its body as it arrives (`read`)."""

    __slots__ = ("method", "path", "raw_path_qs", "headers", "version", "keep_alive", "_conn",
                 "_chunks", "_size", "_complete", "_too_large", "_malformed", "_waiter", "expect",
                 "names")

    def __init__(self, conn: Connection, method: str, path: str, raw_path_qs: str,
                 headers: CIMultiDictProxy[str], version: tuple[int, int], keep_alive: bool,
                 expect: str | None, names: AbstractSet[str] | None = None) -> None:
        self.method = method
        self.path = path
        self.raw_path_qs = raw_path_qs  # the target as the client encoded it (what the relay forwards)
        self.headers = headers
        # The header names present, lower-cased (the parser's, to be read, never changed): None
        # when not known.
        self.names = names
        self.version = version
        self.keep_alive = keep_alive
        self.expect = expect  # the Expect header's value
        self._conn = conn
        self._chunks: list[bytes | bytearray | memoryview] = []
        self._size = 0
        self._complete = False
        self._too_large = False
        self._malformed: str | None = None  # why the body could not be parsed
        self._waiter: asyncio.Future[None] | None = None

    @property
    def rel_url(self) -> Request:  # `request.rel_url.raw_path_qs`, as on an aiohttp request
        return self

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._conn.transport

    @property
    def content(self) -> Request:  # `request.content.is_eof()`, as on an aiohttp request
        return self

    def is_eof(self) -> bool:
        return self._complete

    def body_now(self) -> bytes | None:
        """The whole body if all of it has come and is within the limits, else None (then
        `read` waits for it, or raises what is wrong with it): no coroutine for the common case
        of a small body that came with the headers."""
        if not self._complete or self._too_large or self._malformed is not None:
            return None
        return self._joined()

    async def read(self) -> bytes:
        """The whole body; HTTP 413 (raised, as aiohttp does) past the server's body limit,
        HTTP 400 for a body the parser refused."""
        while not self._complete and not self._too_large and self._malformed is None:
            if self._conn.closing:
                raise ConnectionResetError("client connection closed")
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._malformed is not None:
            raise web.HTTPBadRequest(reason=self._malformed)
        if self._too_large:
            raise web.HTTPRequestEntityTooLarge(self._conn.server.max_body_bytes, self._size)
        return self._joined()

    def _joined(self) -> bytes:
        """The complete body as one bytes object (kept, for a second read). A large body read
        in place is that object already (router/body_bytes.py): no copy."""
        chunks = self._chunks
        if len(chunks) == 1 and type(chunks[0]) is bytes:
            return chunks[0]
        body = b"".join(chunks)
        self._chunks = [body]
        return body

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def bodiless(method: str, status: int) -> bool:
    """Whether an answer to `method` with `status` has no body at all."""
    return method == "HEAD" or status < 200 or status in (204, 304)


class StreamResponse:
    """A response written as it goes: status line and headers leave with the first body bytes
    (one segment, one read for the client), or alone through `send_head` when those bytes are
    not there yet; chunked for HTTP/1.1 clients, ended by closing the connection for HTTP/1.0 ones."""

    def __init__(self, *, status: int = 200, headers: Iterable[tuple[str, str]] | None = None) -> None:
        self.status = status
        self.headers: CIMultiDict[str] = CIMultiDict(headers or ())
        self._conn: Connection | None = None
        self._head: bytes | None = None
        self._chunked = True
        self._bodiless = False
        self.eof_sent = False

    async def prepare(self, request: Request) -> None:
        conn = request._conn
        self._conn = conn
        conn.streaming = self  # (a handler that fails after its head went out cannot answer again)
        # HEAD, 1xx, 204 and 304 answers end with their head (RFC 9112 section 6.3): a body
        # or a chunked terminator would be read as the start of the next answer.
        self._bodiless = bodiless(request.method, self.status)
        self._chunked = request.version >= (1, 1) and not self._bodiless
        if not self._chunked and not self._bodiless:
            conn.must_close = True  # an HTTP/1.0 body ends with the connection
        keep = conn.keeps_alive(request, self.headers)
        if not keep:
            conn.must_close = True
        extra = b"Transfer-Encoding: chunked\r\n" if self._chunked else b""
        self._head = conn.server.head(self.status, self.headers, extra, keep)

    def send_head(self) -> None:
        """Sends the status line and headers now, before any body bytes (a no-op once they
        went out). The client can take in the head (an SDK builds its response and stream
        objects) while the body is still on its way."""
        conn = self._conn
        assert conn is not None, "StreamResponse.prepare() not called"
        head = self._head
        if head is None or conn.closing or conn.transport.is_closing():  # type: ignore[union-attr]
            return
        self._head = None
        conn.transport.write(head)  # type: ignore[union-attr]

    async def write(self, data: bytes) -> None:
        conn = self._conn
        assert conn is not None, "StreamResponse.prepare() not called"
        if conn.closing or conn.transport.is_closing():  # type: ignore[union-attr]
            raise ConnectionResetError("client connection closed")
        if not data or self._bodiless:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        head = self._head
        if head is not None:
            self._head = None
            data = head + data
        conn.transport.write(data)  # type: ignore[union-attr]
        if conn.write_paused:
            await conn.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        conn = self._conn
        assert conn is not None, "StreamResponse.prepare() not called"
        if self.eof_sent:
            return
        self.eof_sent = True
        if conn.closing:
            return
        if self._bodiless:
            data = b""
        elif self._chunked:
            data = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"
        head = self._head
        if head is not None:
            self._head = None
            data = head + data
        if data:
            conn.transport.write(data)  # type: ignore[union-attr]
        if conn.write_paused:
            await conn.drain()
