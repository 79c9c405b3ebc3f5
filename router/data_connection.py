"""One data-port client connection: an asyncio buffered protocol whose requests are parsed by
httptools (llhttp, the parser uvicorn uses) and answered one at a time, each whole answer in one
transport write (router/data_server.py serves them).

Reads go into the server's one read buffer and are parsed from there (the parser copies what it
keeps); the rest of a large Content-Length body is read by the socket straight into the bytes
its handler gets (router/body_bytes.py; router/data_server.py bounds how much may wait so).

One request at a time per connection: pipelined requests are parsed as they arrive and served in
order. A client that goes away cancels its request's handler (the relay then aborts the
replica's). Whole answers are aiohttp `web.Response` values (built by the handlers and the error
helpers the admin API shares) or a relayed `WholeResponse`; streamed ones are `StreamResponse`
(router/data_http.py), whose headers go out with its first body bytes (or alone, when the relay
has none for a while). HEAD, 1xx, 204 and 304 answers carry no body. A client that stops reading
gets no next pipelined answer until it drains the last one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING
from urllib.parse import unquote

import httptools
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from .body_bytes import body_with_room
from .data_http import Request, StreamResponse, WholeResponse, bodiless
from .errors import error_response
from .data_limits import (DIRECT_BODY_BYTES, MALFORMED_KINDS, MAX_HEAD_BYTES, MAX_HEADER_BYTES,
                          MAX_HEADER_COUNT, MAX_HEADERS_TOTAL, MAX_PIPELINED, QUEUED_BODY_BYTES, SINGLETONS,
                          Malformed)

if TYPE_CHECKING:
    from .data_server import DataServer

log = logging.getLogger("kvrouter")

class Connection(asyncio.BufferedProtocol):
    """One client connection: parses requests, serves them one at a time, keeps alive."""

    def __init__(self, server: DataServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closing = False
        self.must_close = False  # close once the response being written is done
        self.upgraded = False  # the client asked for an upgrade: the parser stops there
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._url = b""
        self._raw_headers: list[bytes] = []  # name, value, name, value, ...
        self._header_bytes = 0
        self._in_head = False  # the parser is inside a request's head
        self._heads = 0  # heads begun: one that began in a chunk is not charged that chunk
        self._head_received = 0  # bytes of the current head, but for the chunk it began in
        self._parsing: Request | None = None
        self._queue: deque[Request] = deque()
        self._serving: Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None  # loop time the connection became idle
        self._reading_paused = False
        self._body_length: int | None = None  # the Content-Length of the body being parsed
        self._direct_left = 0  # body bytes still to come past the parser (`_receive_direct`)
        self._direct_body: memoryview | None = None  # where they go: the rest of the body's bytes
        self._direct_owner: bytes | bytearray | None = None  # those bytes, alive while filled
        self._direct_filled = 0  # bytes of `_direct_body` received
        self._input_closed = False  # a request that closes the connection has come: no more are read
        self.streaming: StreamResponse | None = None  # the answer being served, once streamed

    # -- transport events -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport
        # No TCP_NODELAY here: uvloop and asyncio set it on every TCP transport they make, and
        # asking for the socket object costs a new connection four syscalls (an OpenAI SDK
        # client opens one per streamed request). tests/test_dataplane_wire.py checks it is on.
        self.server.connections.add(self)
        self._idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        if self._direct_body is not None:  # a body cut short: its length is no longer awaited
            self._direct_body = self._direct_owner = None
            self.server.body_arrived(self._direct_filled + self._direct_left)
        self._cancel_timer()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client went away: its handler (and the replica's work) ends
        self._queue.clear()
        for request in (self._parsing, self._serving):
            if request is not None:
                request._wake()
        waiter = self._drain
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("client connection closed"))

    def eof_received(self) -> bool:
        """The client's end of its stream is taken as the client gone (False: the transport
        closes, cancelling what it asked for): a socket shut only for writing (a half-close)
        looks the same here as one closed whole, and a stream whose replica is quiet writes
        nothing that would find the latter gone."""
        return False

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self._drain
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        if self.closing:
            raise ConnectionResetError("client connection closed")
        if self.write_paused:
            self._drain = self.loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the transport reads next: the rest of a large body's bytes while one is being
        received, else the server's read buffer (parsed, and so copied, before the next read)."""
        body = self._direct_body
        if body is not None:
            return body[self._direct_filled:]
        return self.server.read_view

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct_body is not None:
            if not self.closing:
                self._direct_received(nbytes)
            return
        self._received(self.server.read_view[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        """A transport without buffers (uvloop's and asyncio's use them): the same parse."""
        self._received(data)

    def _received(self, data: bytes | memoryview) -> None:
        if self.closing or self.upgraded or self._input_closed:
            return
        if self._direct_left:
            data = self._receive_direct(data)
            if not data or self._input_closed:
                return
        in_head, heads = self._in_head, self._heads
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No upgrades here: the request is answered as a plain one, then the connection
            # closes (what follows an upgrade request is not HTTP).
            self.upgraded = self.must_close = True
            if self._serving is None and not self._queue:
                self._close()
        except httptools.HttpParserError as err:
            if self._input_closed:  # bytes after a request that closes: not read (and not an
                return  # error that would drop the requests queued before it)
            cause = err.__context__  # what one of the callbacks below raised, if it was one
            if isinstance(cause, Malformed):
                self._protocol_error(cause.status, f"malformed HTTP request: {cause}")
            else:
                self._protocol_error(400, f"malformed HTTP request: {str(err)[:300]}")
            return
        if in_head and self._in_head and heads == self._heads:  # all of `data` was one head's
            self._head_received += len(data)
            if self._head_received > MAX_HEAD_BYTES:
                self._protocol_error(431, "malformed HTTP request: request headers too large")
                return
        request = self._parsing
        if request is not None and self._body_length is not None and not self._in_head \
                and not request._complete and not request._too_large:
            left = self._body_length - request._size
            # (not while other bodies still to come hold the server's budget: then the parser
            # takes it as it comes)
            if left >= DIRECT_BODY_BYTES and self.server.reserve_body(left):
                try:
                    body, self._direct_body = body_with_room(request._chunks, left)
                except MemoryError:
                    self.server.body_arrived(left)  # never awaited after all
                    raise
                request._chunks, self._direct_owner = [body], body  # the handler's, once whole
                self._direct_left, self._direct_filled = left, 0

    def _receive_direct(self, data: bytes | memoryview) -> bytes | memoryview:
        """Copy the body's next bytes from `data` into its buffer; returns the rest of `data`."""
        left = self._direct_left
        piece, rest = (data, b"") if len(data) <= left else (data[:left], data[left:])
        filled = self._direct_filled
        self._direct_body[filled:filled + len(piece)] = piece  # type: ignore[index]
        self._direct_received(len(piece))
        return rest

    def _direct_received(self, nbytes: int) -> None:
        """`nbytes` more of the body are in its buffer; once it is whole, the request is complete
        and a new parser (the old one still counts the body) takes what follows."""
        self._direct_filled += nbytes
        self._direct_left -= nbytes
        request = self._parsing
        if request is not None and not request._too_large:
            request._size += nbytes
            self._pause_if_queued(request)
        if not self._direct_left:
            self._direct_body = self._direct_owner = None
            self.server.body_arrived(self._direct_filled)
            self.parser = httptools.HttpRequestParser(self)
            self.on_message_complete()

    # -- parser callbacks ------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._raw_headers = []
        self._header_bytes = 0
        self._in_head = True
        self._body_length = None
        self._heads += 1
        self._head_received = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_HEADER_BYTES:
            raise Malformed(431, "request target too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value)
        self._header_bytes += size
        if size > MAX_HEADER_BYTES or self._header_bytes > MAX_HEADERS_TOTAL:
            raise Malformed(431, "request headers too large")
        raw = self._raw_headers
        if len(raw) >= 2 * MAX_HEADER_COUNT:
            raise Malformed(431, f"more than {MAX_HEADER_COUNT} request headers")
        raw.append(name)  # names and values in one flat list: decoded, and checked for
        raw.append(value)  # repeats, once all have come

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self.parser
        url = self._url
        if url[:1] != b"/":  # absolute form (or "*"): only its path and query are ours
            try:
                parsed = httptools.parse_url(url)
            except httptools.HttpParserInvalidURLError:
                raise httptools.HttpParserError("invalid request target") from None
            raw = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
        else:
            raw = url
        raw_path_qs = raw.decode("latin-1")
        raw_path = raw_path_qs.partition("?")[0]
        path = unquote(raw_path) if "%" in raw_path else raw_path
        version = (1, 1) if parser.get_http_version() == "1.1" else (1, 0)
        raw_headers = self._raw_headers
        # Names and values decoded in one go, split at the line feeds none of them holds (a
        # value folded over lines does: then each is decoded on its own).
        texts = b"\n".join(raw_headers).decode("latin-1").split("\n")
        if len(texts) != len(raw_headers):
            texts = [field.decode("latin-1") for field in raw_headers]
        pairs = iter(texts)
        headers = CIMultiDict(list(zip(pairs, pairs)))
        lowered = set(map(str.lower, texts[::2]))  # the names present (token characters: ASCII)
        if len(lowered) != len(headers):  # a field repeated: refused if it must be single
            for name in SINGLETONS.intersection(lowered):
                if len(headers.getall(name)) > 1:  # which value counts is ambiguous
                    raise Malformed(400, f"duplicate {name} header")
        request = Request(self, parser.get_method().decode("latin-1"), path, raw_path_qs,
                          CIMultiDictProxy(headers), version, parser.should_keep_alive(),
                          headers.get("Expect") if "expect" in lowered else None, lowered)
        self._parsing = request
        coding = None
        if "transfer-encoding" in lowered:
            coding = headers["Transfer-Encoding"]
            if coding.rpartition(",")[2].strip().lower() != "chunked":
                # No way to know where such a body ends (RFC 9112 section 6.3): refused, not
                # read to the connection's close.
                raise Malformed(400, "a request Transfer-Encoding must end in chunked")
        self._body_length = None
        if "content-length" in lowered:
            length = headers["Content-Length"]
            if length.isdigit():
                size = int(length)
                if size > self.server.max_body_bytes:
                    request._too_large = True
                elif coding is None and size >= DIRECT_BODY_BYTES and request.method != "CONNECT" \
                        and "upgrade" not in lowered:  # (after an upgrade the parser decides)
                    self._body_length = size
        if self._serving is None:
            self._serve(request)
        else:
            self._queue.append(request)
            if len(self._queue) >= MAX_PIPELINED and not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]

    def on_body(self, body: bytes | memoryview) -> None:
        request = self._parsing
        if request is None or request._too_large:
            return
        request._size += len(body)
        if request._size > self.server.max_body_bytes:
            request._too_large = True
            request._chunks = []
            request._wake()
            return
        request._chunks.append(body)
        self._pause_if_queued(request)

    def _pause_if_queued(self, request: Request) -> None:
        if request._size > QUEUED_BODY_BYTES and self._serving not in (None, request) \
                and not self._reading_paused:
            # A request queued behind the one being served: nobody reads its body yet, and
            # `_finished` resumes reading when its turn comes.
            self._reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        request = self._parsing
        if request is not None:
            self._parsing = None
            request._complete = True
            if not request.keep_alive:
                self._input_closed = True
            request._wake()

    # -- serving -----------------------------------------------------------------------------------
    def _serve(self, request: Request) -> None:
        self._idle_since = None  # a request is being served: the idle timer lets it be
        self._serving = request
        expect = request.expect
        if expect is not None:
            if expect.lower() != "100-continue":
                self._answer_now(request, error_response(
                    417, "unsupported Expect header (only 100-continue)", "invalid_request_error",
                    {"Connection": "close"}))
                return
            if request.version >= (1, 1) and not request._complete and not request._too_large:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
        self._task = self.loop.create_task(self._run(request))

    def _answer_now(self, request: Request, response: web.Response) -> None:
        self.must_close = True
        self._write_whole(request, response)
        self._finished(request)

    async def _run(self, request: Request) -> None:
        self.streaming = None
        try:
            server = self.server  # (`DataServer.dispatch`, without a coroutine of its own)
            method = request.method
            chain = server._chains.get((request.path, "GET" if method == "HEAD" else method))
            response = await (chain or server._unrouted)(request)
        except asyncio.CancelledError:
            if self.closing:
                return  # the client went away
            raise
        except ConnectionResetError:
            return
        except Exception:  # a bug must still answer in the API's shape, and never kill the loop
            log.exception("unhandled error on %s %s", request.method, request.path)
            response = error_response(500, "internal router error", "internal_error")
        if self.closing:
            return
        started = self.streaming
        if started is not None and started is not response and started._head is None:
            # The handler failed after its stream's head went out: another answer would land
            # inside that body. Closing ends the stream; the client sees it cut short.
            log.error("%s %s failed after its answer began: connection closed", request.method, request.path)
            self._close()
            return
        try:
            if isinstance(response, StreamResponse):
                if response._conn is None:
                    await response.prepare(request)
                if not response.eof_sent:
                    await response.write_eof()
            else:
                self._write_whole(request, response)
                if self.write_paused and not self.must_close:  # no next answer queued unread
                    await self.drain()
        except ConnectionResetError:
            return
        except Exception:  # an answer that cannot be written: the client still gets an end
            log.exception("unwritable answer to %s %s", request.method, request.path)
            if isinstance(response, StreamResponse) and response._conn is not None \
                    and response._head is None:
                self._close()  # its head and some body went out: closing ends it
            else:
                self._answer_now(request, error_response(500, "internal router error", "internal_error"))
            return
        self._finished(request)

    def _write_whole(self, request: Request, response: web.StreamResponse | WholeResponse) -> None:
        if self.closing:
            return
        body = response.body if isinstance(response, (WholeResponse, web.Response)) else None
        if not isinstance(body, (bytes, bytearray)):
            body = b""
        keep = self.keeps_alive(request, response.headers) and response.keep_alive is not False
        if request._too_large or not request._complete and request._size > 0:
            keep = False  # what is left of the body is not worth reading
        if not keep:
            self.must_close = True
        extra = b"Content-Length: %d\r\n" % len(body)  # for HEAD: the length GET would have
        if bodiless(request.method, response.status):
            body = b""
            if request.method != "HEAD":
                extra = b""  # 1xx, 204, 304: no body and no length
        if keep and request.version < (1, 1):  # a 1.0 client assumes a close unless told
            extra += b"Connection: keep-alive\r\n"
        head = self.server.head(response.status, response.headers, extra, keep, response.reason)
        self.transport.write(head + body)  # type: ignore[union-attr]

    def keeps_alive(self, request: Request, headers: CIMultiDict[str] | CIMultiDictProxy[str]) -> bool:
        if self.must_close or self.server.stopping or not request.keep_alive:
            return False
        connection = headers.get("Connection")
        return connection is None or connection.lower() != "close"

    def _finished(self, request: Request) -> None:
        self._serving = None
        self._task = None
        if not request._complete:  # answered before its body ended: the rest is read past
            request._too_large = True  # (`on_body` keeps no more of it)
            request._chunks = []
        if self.must_close or self.closing:
            self._close()
            return
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        if self._queue:
            self._serve(self._queue.popleft())
        elif self.server.stopping:
            self._close()
        else:
            self._idle()

    def _protocol_error(self, status: int, message: str) -> None:
        """The parser's state is unknown after a protocol error: answer (if nothing is being
        answered now) and close."""
        self._queue.clear()
        self._parsing = None
        serving = self._serving
        if serving is not None:
            self.must_close = True
            if not serving._complete:  # the error is in its body: its reader learns it now
                serving._malformed = message
                serving._wake()
            if self.transport is not None and not self.closing:
                self.transport.pause_reading()
            return
        response = error_response(status, message, MALFORMED_KINDS.get(status, "invalid_request_error"),
                                  {"Connection": "close"})
        body = response.body
        assert isinstance(body, bytes)
        head = self.server.head(status, response.headers, b"Content-Length: %d\r\n" % len(body),
                                False, response.reason)
        if self.transport is not None and not self.closing:
            self.transport.write(head + body)
        self._close()

    # -- idle connections --------------------------------------------------------------------------
    def _idle(self) -> None:
        """No request being served: one must arrive (its headers complete) within the header
        timeout, counted from now, or the connection is closed (bounds slowloris clients).
        One timer outlives the requests of a keep-alive connection: serving one only clears
        `_idle_since`, and the timer, when it fires, closes or sleeps until the next deadline
        (no timer made and cancelled per request)."""
        self._idle_since = now = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_at(now + self.server.header_timeout_s, self._idle_check)

    def _idle_check(self) -> None:
        self._timer = None
        since = self._idle_since
        if since is None:
            return  # serving: the next `_idle` arms the timer again
        due = since + self.server.header_timeout_s
        if self.loop.time() >= due:
            self._close()
        else:
            self._timer = self.loop.call_at(due, self._idle_check)

    def _cancel_timer(self) -> None:
        self._idle_since = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def idle(self) -> bool:
        return self._serving is None and not self._queue

    def _close(self) -> None:
        self._cancel_timer()
        if self.transport is not None and not self.closing:
            self.closing = True
            self.transport.close()
