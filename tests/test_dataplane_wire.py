"""Wire-level guarantees of the relay (no timing assertions):

- a streamed response's status line and headers leave in the same write as its first event when
  that event comes with the replica's headers or shortly after (one read for the client), and
  alone when it does not (the client takes in the head while the replica prefills, as it would
  from the replica itself); checked at the socket;
- TCP_NODELAY on both of the router's sockets (client side and replica side);
- a stream's last bytes leave in the same write as the end of the chunked body once the
  replica's end has arrived with them (one write, not two);
- SSE events split anywhere across upstream reads are relayed byte-identical, and a stream that
  breaks mid-event delivers only whole events, then the error event.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web

from kvrouter.router import stream_relay as relay_module
from kvrouter.router.app import Router
from kvrouter.router.config import parse_config
from kvrouter.router.serve import start_site

CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'


def _replica_app(chat) -> web.Application:
    """A replica answering chat completions with `chat`, and its health check."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


def scripted_upstream(pieces: list[bytes], delay_s: float = 0.02, abort: bool = False,
                      last_with_end: bool = False) -> web.Application:
    """Writes `pieces` one by one with a pause between them (so the router reads them apart);
    `last_with_end`: the last piece goes out in the same write as the end of the body."""

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, piece in enumerate(pieces):
            await asyncio.sleep(delay_s)
            if last_with_end and i == len(pieces) - 1:
                await resp.write_eof(piece)
                return resp
            await resp.write(piece)
        if abort:
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write_eof()
        return resp

    return _replica_app(chat)


async def _router(replica: str) -> tuple[Router, web.AppRunner, int]:
    router = Router(parse_config({"replicas": [replica], "signals": {"source": "health"}}))
    runner, port = await start_site(router, "127.0.0.1", 0)
    return router, runner, port


async def _raw_upstream(first: bytes, rest: bytes, release: asyncio.Event) -> tuple[asyncio.Server, str]:
    """A replica that writes its response head and `first` (a chunk of an SSE body) in one
    write, then `rest` and the end once `release` is set."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n" % (len(first), first))
        await release.wait()
        writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(rest), rest))
        await writer.drain()
        await reader.read()  # the router keeps the connection: wait for it to go
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _post(writer: asyncio.StreamWriter) -> None:
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT))


async def _read_to_chunked_end(reader: asyncio.StreamReader) -> bytes:
    """What the client reads until the chunked body's terminator."""
    body = b""
    while not body.endswith(b"0\r\n\r\n"):
        got = await asyncio.wait_for(reader.read(65536), 10)
        assert got, body
        body += got
    return body


async def _post_and_read_once(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A client's connection to the router on `port`, its streamed chat request, its first read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    _post(writer)
    await writer.drain()
    return reader, writer, await asyncio.wait_for(reader.read(65536), 10)


async def test_headers_leave_with_a_first_event_that_came_with_them_and_nodelay_on_both_sides():
    first, rest = b'data: {"n":0}\n\n', b"data: [DONE]\n\n"
    release = asyncio.Event()
    server, replica = await _raw_upstream(first, rest, release)
    router, runner, port = await _router(replica)
    try:
        reader, writer, head = await _post_and_read_once(port)
        # The replica's first event came with its headers: both reach the client in one write.
        assert head.startswith(b"HTTP/1.1 200") and first in head, head
        # Both of the router's sockets for this exchange have Nagle off.
        server_socks = [h.transport.get_extra_info("socket") for h in runner.connections
                        if h.transport is not None]
        assert server_socks
        assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in server_socks)
        upstream_socks = [t.get_extra_info("socket") for t in router.relay.pool.connections()]
        assert upstream_socks
        assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in upstream_socks)
        release.set()
        body = await _read_to_chunked_end(reader)
        assert rest in body
        writer.close()
    finally:
        await runner.cleanup()
        server.close()


def _head_then_event_upstream(first: bytes, release: asyncio.Event, pause_s: float = 0.0) -> web.Application:
    """Sends its headers, then `first` in a write of its own once `release` is set and `pause_s`
    has passed, then the end."""

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # (aiohttp sends its head now)
        await release.wait()
        await asyncio.sleep(pause_s)
        await resp.write(first)
        await resp.write_eof()
        return resp

    return _replica_app(chat)


async def test_an_event_shortly_after_the_replicas_headers_leaves_with_them(start_app, monkeypatch):
    monkeypatch.setattr(relay_module, "_HEAD_ALONE_AFTER_S", 5.0)  # "shortly": well within it
    first = b'data: {"n":0}\n\n'
    release = asyncio.Event()
    release.set()
    router, runner, port = await _router(await start_app(_head_then_event_upstream(first, release, 0.05)))
    try:
        reader, writer, head = await _post_and_read_once(port)
        # The replica's head and its first event came in two reads 50 ms apart: one write.
        assert head.startswith(b"HTTP/1.1 200") and first in head, head
        writer.close()
    finally:
        await runner.cleanup()


async def test_headers_leave_alone_while_the_replica_holds_its_first_event(start_app):
    first = b'data: {"n":0}\n\n'
    release = asyncio.Event()
    router, runner, port = await _router(await start_app(_head_then_event_upstream(first, release)))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        _post(writer)
        await writer.drain()
        # The replica holds its first event until the client has the head: it comes alone
        # (once _HEAD_ALONE_AFTER_S has passed).
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"transfer-encoding: chunked" in head.lower(), head
        release.set()
        body = await _read_to_chunked_end(reader)
        assert body == b"%x\r\n%b\r\n0\r\n\r\n" % (len(first), first), body
        writer.close()
    finally:
        release.set()
        await runner.cleanup()


class _CountingTransport:
    """Stands in for a server connection's transport: counts the writes that pass through."""

    def __init__(self, real: asyncio.Transport) -> None:
        self.real = real
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.real.write(data)

    def writelines(self, lines: list[bytes]) -> None:
        self.writes.append(b"".join(lines))
        self.real.writelines(lines)

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


async def test_the_last_event_leaves_with_the_end_of_the_body(start_app):
    first, last = b'data: {"n":0}\n\n', b"data: [DONE]\n\n"
    replica = await start_app(scripted_upstream([first, last], delay_s=0.5, last_with_end=True))
    router, runner, port = await _router(replica)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT))
        await writer.drain()
        head = b""
        while first not in head:  # (the head goes out alone while the replica holds the event)
            got = await asyncio.wait_for(reader.read(65536), 10)
            assert got, head
            head += got
        # The replica sends its last event 0.5 s later; count the router's writes from here on.
        [handler] = [h for h in runner.connections if h.transport is not None]
        counting = _CountingTransport(handler.transport)
        handler.transport = counting  # type: ignore[assignment]
        rest = b""
        while not rest.endswith(b"0\r\n\r\n"):
            got = await asyncio.wait_for(reader.read(65536), 10)
            assert got, rest
            rest += got
        assert counting.writes == [rest], counting.writes
        assert last in rest
        writer.close()
    finally:
        await runner.cleanup()


EVENTS = [b'data: {"a":1}\n\n', b'data: {"b":2}\r\n\r\n', b"event: x\ndata: {\"c\":3}\n\n",
          b'data: {"d":4}\n\n', b"data: [DONE]\n\n"]


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    out, last = [], 0
    for c in sorted(set(cuts)):
        if 0 < c < len(data):
            out.append(data[last:c])
            last = c
    return out + [data[last:]]


async def test_events_split_anywhere_are_relayed_byte_identical(start_app):
    stream = b"".join(EVENTS)
    seps = [i for i in range(len(stream)) if stream[i:i + 1] in (b"\n", b"\r")]
    patterns = [
        [s + 1 for s in seps],                                # after every line-ending byte
        [s for s in seps],                                    # just before each
        list(range(3, len(stream), 7)),                       # arbitrary
    ]
    for cuts in patterns:
        replica = await start_app(scripted_upstream(_split(stream, cuts), delay_s=0.005))
        _, runner, port = await _router(replica)
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=CHAT,
                                       headers={"Content-Type": "application/json"}) as resp:
                    assert await resp.read() == stream
        finally:
            await runner.cleanup()


async def test_break_mid_event_delivers_whole_events_then_the_error(start_app):
    # Two whole events, then half of a third split over two reads, then the connection dies.
    pieces = [EVENTS[0] + EVENTS[1][:5], EVENTS[1][5:] + b'data: {"tru', b'ncated":']
    replica = await start_app(scripted_upstream(pieces, delay_s=0.01, abort=True))
    _, runner, port = await _router(replica)
    try:
        async with aiohttp.ClientSession() as client:
            async with client.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=CHAT,
                                   headers={"Content-Type": "application/json"}) as resp:
                body = await resp.read()
    finally:
        await runner.cleanup()
    assert body.startswith(EVENTS[0] + EVENTS[1])
    rest = body[len(EVENTS[0] + EVENTS[1]):]
    assert b"tru" not in rest and rest.startswith(b"data: {\"error\""), rest
    assert rest.endswith(b"data: [DONE]\n\n")
