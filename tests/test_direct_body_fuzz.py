"""Large Content-Length bodies taken past the HTTP parser (router/data_connection.py) give the
same requests, bodies, answers and connection ends as the parser path, however the client's
bytes are split into reads, whether they come as bytes (`data_received`) or are read into the
buffers the connection hands out (`get_buffer`, `buffer_updated`, as uvloop and asyncio's own
transports read a buffered protocol).

The real `Connection` and `DataServer` (routes, the errors middleware) are driven through an
in-memory transport: the split of the bytes into reads is what is varied, and a loopback socket
cannot pin where its reads end.
"""

from __future__ import annotations

import asyncio
import gc
import re
from typing import Any
from unittest import mock

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouter.router import body_bytes, data_connection, data_limits
from kvrouter.router.data_connection import Connection
from kvrouter.router.data_http import Request
from kvrouter.router.data_server import DataServer
from kvrouter.router.middlewares import errors_middleware

MAX_BODY = 150_000
DIRECT = data_limits.DIRECT_BODY_BYTES
_SIZES = [0, 7, DIRECT - 1, DIRECT, DIRECT + 1, DIRECT + 4096, 2 * DIRECT, MAX_BODY, MAX_BODY + 1]


class MemoryTransport:
    """What `Connection` uses of a transport; a close ends the connection on the next loop turn."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.written: list[bytes] = []
        self.closed_after: int | None = None  # bytes written when it closed
        self.paused = False

    def write(self, data: bytes) -> None:
        assert self.closed_after is None, "written after close"
        self.written.append(bytes(data))

    def close(self) -> None:
        if self.closed_after is None:
            self.closed_after = sum(map(len, self.written))
            asyncio.get_running_loop().call_soon(self.conn.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closed_after is not None

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return 0


def _server(routes: dict[str, Any]) -> DataServer:
    server = DataServer(routes, [errors_middleware(MAX_BODY)], [], max_body_bytes=MAX_BODY,
                        header_timeout_s=60, shutdown_grace_s=0)
    server.loop = asyncio.get_running_loop()
    return server


def _connection(server: DataServer) -> tuple[Connection, MemoryTransport]:
    """A connection of `server`, made, on an in-memory transport."""
    conn = Connection(server)
    transport = MemoryTransport(conn)
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def _body(tag: int, size: int) -> bytes:
    return (b"%d-0123456789abcdef" % tag * (size // 16 + 1))[:size]


def _wire(spec: dict[str, Any], tag: int) -> tuple[bytes, int]:
    """One request's bytes, and where its head ends."""
    body = _body(tag, spec["size"])
    lines = [f"{spec['method']} {spec['path']} HTTP/1.{0 if spec['http10'] else 1}", "Host: x"]
    framing = spec["framing"]
    if framing in ("length", "both"):
        lines.append(f"Content-Length: {len(body)}")
    if framing in ("chunked", "both"):
        lines.append("Transfer-Encoding: chunked")
    if spec["connection"]:
        lines.append(f"Connection: {spec['connection']}")
    if spec["expect"]:
        lines.append("Expect: 100-continue")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    if framing in ("chunked", "both"):
        half = len(body) // 2
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:]) if p) + b"0\r\n\r\n"
    return head + body, len(head)


_request = st.fixed_dictionaries({
    "method": st.sampled_from(["POST", "POST", "GET", "HEAD", "PUT"]),
    "path": st.sampled_from(["/echo", "/echo", "/slow", "/early", "/missing"]),
    "size": st.one_of(st.sampled_from(_SIZES), st.integers(0, MAX_BODY + 10)),
    "framing": st.sampled_from(["length", "length", "length", "chunked", "both", "none"]),
    "connection": st.sampled_from([None, None, "close", "keep-alive"]),
    "http10": st.booleans(),
    "expect": st.booleans(),
})


def _read_into_buffers(conn: Connection, data: bytes) -> None:
    """What a transport does with one read's worth of bytes for a buffered protocol: fill the
    buffer `get_buffer` hands out (never past its end), report it, and so on to the last byte."""
    while data:
        buffer = conn.get_buffer(-1)
        assert len(buffer) > 0
        n = min(len(buffer), len(data))
        buffer[:n] = data[:n]
        conn.buffer_updated(n)
        data = data[n:]


async def _served(wire: bytes, cuts: list[int], drop_at: int | None, direct: bool,
                  buffered: bool = False) -> Any:
    """Feed `wire` in the reads `cuts` make (the client going away before read `drop_at`) and
    return everything observable: the requests the handlers saw, the bytes written (Date
    fields aside), when the connection closed, and at which read it stayed paused. "/slow" is
    answered once reading pauses or all is fed, so the requests behind it queue."""
    seen: list[Any] = []
    gate = asyncio.Event()

    def record(request: Request, body: bytes | None) -> None:
        seen.append((request.method, request.path, tuple(request.headers.items()), request.version,
                     request.keep_alive, body))

    async def echo(request: Request) -> web.Response:
        body = await request.read()
        record(request, body)
        return web.Response(body=b"%d:%s" % (len(body), body[-40:]))

    async def slow(request: Request) -> web.Response:
        body = await request.read()
        record(request, body)
        await gate.wait()
        return web.Response(body=b"slow %d" % len(body))

    async def early(request: Request) -> web.Response:
        record(request, None)  # answered before its body is read
        return web.Response(body=b"early")

    routes = {"/echo": {m: echo for m in ("GET", "POST", "PUT")}, "/early": {"POST": early, "PUT": early},
              "/slow": {"POST": slow, "GET": slow}}
    server = _server(routes)
    with mock.patch.object(data_connection, "DIRECT_BODY_BYTES", DIRECT if direct else 1 << 62):
        conn, transport = _connection(server)
        stuck_at = None
        edges = [0, *cuts, len(wire)]
        for n, (start, end) in enumerate(zip(edges, edges[1:])):
            for _ in range(30):  # the handlers run between reads
                await asyncio.sleep(0)
            if conn.closing:
                break
            if n == drop_at:
                conn.connection_lost(ConnectionResetError())
                break
            if transport.paused:  # a real transport holds these bytes back: the queue must drain
                gate.set()
                for _ in range(30):
                    await asyncio.sleep(0)
                if transport.paused:
                    stuck_at = n
                    break
            if buffered:
                _read_into_buffers(conn, wire[start:end])
            else:
                conn.data_received(wire[start:end])
        gate.set()
        for _ in range(30):
            await asyncio.sleep(0)
        task = conn._task
        assert task is None or task.done() or not conn.closing, "a handler outlives its connection"
        if task is not None and not task.done():
            task.cancel()
    out = re.sub(rb"Date: [^\r]*\r\n", b"", b"".join(transport.written))
    return seen, out, transport.closed_after, stuck_at, conn.closing


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(_request, min_size=1, max_size=3), data=st.data())
def test_direct_bodies_serve_exactly_as_the_parser_path_at_any_split(requests, data) -> None:
    wire, marks = b"", []
    for tag, spec in enumerate(requests):
        one, head = _wire(spec, tag)
        marks += [len(wire) + head, len(wire) + len(one)]
        wire += one
    near = st.sampled_from(marks).flatmap(lambda m: st.integers(m - 2, m + 2))
    cut = st.one_of(st.integers(0, len(wire)), near, st.sampled_from(marks).map(lambda m: m + DIRECT))
    cuts = sorted({c for c in data.draw(st.lists(cut, max_size=8), label="cuts") if 0 < c < len(wire)})
    drop_at = data.draw(st.one_of(st.none(), st.integers(0, len(cuts))), label="drop_at")
    old = asyncio.run(_served(wire, cuts, drop_at, direct=False))
    assert asyncio.run(_served(wire, cuts, drop_at, direct=True)) == old
    assert asyncio.run(_served(wire, cuts, drop_at, direct=True, buffered=True)) == old


# No body, a short one, or any (a chunked one, one sent with no framing at all among them)
_led_request = st.one_of(_request, _request.map(lambda spec: {**spec, "size": 0}),
                         _request.map(lambda spec: {**spec, "size": spec["size"] % 3000}))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(_led_request, max_size=3), data=st.data())
def test_large_reads_that_begin_a_request_serve_exactly_as_the_parser_path(requests, data) -> None:
    """Reads over the direct-body size that begin at a request's start (its head then split off
    for the parser), with the requests pipelined behind it in the same read, each served as the
    plain parser path serves it."""
    large = data.draw(_request.map(lambda spec: {**spec, "size": DIRECT + spec["size"] % MAX_BODY}), label="large")
    requests.insert(data.draw(st.integers(0, len(requests)), label="large at"), large)  # (so the wire is long)
    wire, starts = b"", []
    for tag, spec in enumerate(requests):
        starts.append(len(wire))
        wire += _wire(spec, tag)[0]
    edges: set[int] = set()
    for start in data.draw(st.lists(st.sampled_from(starts), min_size=1, max_size=4), label="read starts"):
        edges.add(start)  # a read begins there and runs on past the direct-body size
        edges.add(start + DIRECT + data.draw(st.sampled_from([1, 5, 4096, 70_000, 1 << 20]), label="over"))
    cuts = sorted(c for c in edges if 0 < c < len(wire))
    drop_at = data.draw(st.one_of(st.none(), st.integers(0, len(cuts))), label="drop_at")
    old = asyncio.run(_served(wire, cuts, drop_at, direct=False))
    assert asyncio.run(_served(wire, cuts, drop_at, direct=True)) == old
    assert asyncio.run(_served(wire, cuts, drop_at, direct=True, buffered=True)) == old


@pytest.mark.parametrize("size", [100, 2 * DIRECT], ids=["parsed-body", "direct-body"])
async def test_a_queued_request_that_closes_is_answered_and_nothing_after_it_is_served(size: int) -> None:
    """A request with `Connection: close`, queued behind a slow one, with the client's next
    request already behind it: the first two are answered in order (the second with the close),
    what follows the close is neither served nor makes the server drop the accepted second."""
    gate = asyncio.Event()
    served: list[str] = []

    async def slow(request: Request) -> web.Response:
        await request.read()
        await gate.wait()
        served.append("slow")
        return web.Response(body=b"slow")

    async def echo(request: Request) -> web.Response:
        body = await request.read()
        served.append(f"echo {len(body)}")
        return web.Response(body=b"echo %d" % len(body))

    server = _server({"/slow": {"POST": slow}, "/echo": {"POST": echo}})
    conn, transport = _connection(server)
    body = _body(1, size)
    closing = b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % size
    conn.data_received(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n" + closing)
    await asyncio.sleep(0)
    conn.data_received(body[:size // 2])
    await asyncio.sleep(0)
    conn.data_received(body[size // 2:] + b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    gate.set()
    for _ in range(200):
        if transport.closed_after is not None:
            break
        await asyncio.sleep(0)
    out = re.sub(rb"Date: [^\r]*\r\n", b"", b"".join(transport.written))
    assert served == ["slow", f"echo {size}"]
    assert out == (b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nslow"
                   b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\necho %d"
                   % (len(b"echo %d" % size), size))
    assert transport.closed_after == sum(map(len, transport.written))  # closed once both are out


async def test_a_large_content_length_with_a_transfer_encoding_is_refused_not_read_past_the_parser() -> None:
    """Both framings at once (a request smuggling shape): a 400 and a close, nothing dispatched,
    however large the Content-Length."""
    spec = {"method": "POST", "path": "/echo", "size": 2 * DIRECT, "framing": "both", "connection": None,
            "http10": False, "expect": False}
    wire, head = _wire(spec, 0)
    seen, out, closed_after, _, closing = await _served(wire, [head, head + 10], None, direct=True)
    assert not seen and closing and out.startswith(b"HTTP/1.1 400 ") and b"Connection: close" in out
    assert closed_after is not None


@pytest.mark.parametrize("in_place", [True, False])
async def test_a_large_body_is_read_straight_into_the_bytes_its_handler_gets(
        in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a large body's head is parsed, the connection hands the transport the rest of a
    bytes object as long as the body (not the server's shared read buffer), after the bytes
    that came with the head, and the handler gets that very object, uncopied; the next
    request's reads go to the shared buffer again, and the next large body gets bytes of its
    own. Where bytes cannot be filled in place, a bytearray is, and copied once."""
    if not in_place:
        monkeypatch.setattr(body_bytes, "_OFFSET", None)
    else:  # the interpreters the router runs on pass the layout check made at import
        assert body_bytes.in_place_available()
    seen: list[bytes] = []

    async def echo(request: Request) -> web.Response:
        body = await request.read()
        seen.append(body)
        return web.Response(body=b"%d" % len(body))

    server = _server({"/echo": {"POST": echo}})
    conn, transport = _connection(server)
    size = 2 * DIRECT + 123
    body = _body(3, size)
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size
    assert conn.get_buffer(-1).obj is server.read_buffer
    _read_into_buffers(conn, head + body[:1000])
    buffer = conn.get_buffer(-1)
    assert buffer.obj is not server.read_buffer and len(buffer) == size - 1000
    target = conn._direct_owner  # what the view writes into, held while it is filled
    assert type(target) is (bytes if in_place else bytearray) and len(target) == size
    assert in_place or buffer.obj is target
    buffer[:size - 1000] = body[1000:]
    del buffer  # (a transport lets go of the view once the read is reported)
    conn.buffer_updated(size - 1000)
    for _ in range(50):
        if seen:
            break
        await asyncio.sleep(0)
    assert seen == [body] and type(seen[0]) is bytes
    assert (seen[0] is target) is in_place and conn._direct_owner is None
    assert conn.get_buffer(-1).obj is server.read_buffer
    for _ in range(50):
        if transport.written:
            break
        await asyncio.sleep(0)
    assert b"".join(transport.written).endswith(b"\r\n\r\n%d" % size)
    # The next large body (a little shorter here) is read into bytes of its own, and the
    # first body, already handed over, is unchanged.
    second = _body(4, size - 5000)
    _read_into_buffers(conn, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(second))
    assert conn.get_buffer(-1).obj is not server.read_buffer
    _read_into_buffers(conn, second)
    for _ in range(50):
        if len(seen) == 2:
            break
        await asyncio.sleep(0)
    assert seen == [body, second] and seen[0] is not seen[1]
    assert server.awaited_body_bytes == 0


async def test_a_large_body_answered_before_it_is_whole_stays_held_until_the_connection_ends() -> None:
    """A handler that answers without reading its large body lets the request drop it (and the
    connection closes after the answer); what the transport may still read goes into those
    bytes, which a view of them does not keep alive: the connection holds them until it ends,
    then gives the body's share of the budget back."""

    async def quick(request: Request) -> web.Response:
        return web.Response(body=b"early")

    server = _server({"/quick": {"POST": quick}})
    conn, transport = _connection(server)
    body = _body(7, 2 * DIRECT + 500)
    _read_into_buffers(conn, b"POST /quick HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                       + body[:500])
    held = conn._direct_owner
    assert held is not None and server.awaited_body_bytes == len(body) - 500
    for _ in range(50):
        if transport.written:
            break
        await asyncio.sleep(0)
    assert b"".join(transport.written).endswith(b"early") and conn.closing
    gc.collect()
    assert conn._direct_owner is held  # the request let go of it; the connection has not
    _read_into_buffers(conn, body[500:1500])  # a read already under way lands in live memory
    for _ in range(50):
        if conn not in server.connections:
            break
        await asyncio.sleep(0)
    assert conn._direct_owner is None and conn._direct_body is None
    assert server.awaited_body_bytes == 0


async def test_a_body_not_yet_read_keeps_its_buffer_from_the_next_large_body() -> None:
    """A large body complete but not yet read by its handler (queued behind a slow answer)
    while the next large body arrives: the later one gets a buffer of its own, and each
    handler reads its own body."""
    gate = asyncio.Event()
    seen: list[bytes] = []

    async def hold(request: Request) -> web.Response:
        await gate.wait()
        seen.append(await request.read())
        return web.Response(body=b"held")

    server = _server({"/hold": {"POST": hold}})
    conn, transport = _connection(server)
    first, second = _body(5, 2 * DIRECT), _body(6, 2 * DIRECT + 77)
    for body in (first, second):
        _read_into_buffers(conn, b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        _read_into_buffers(conn, body)
        await asyncio.sleep(0)
    gate.set()
    for _ in range(100):
        if len(seen) == 2:
            break
        await asyncio.sleep(0)
    assert seen == [first, second]


async def test_a_large_body_that_cannot_be_allocated_gives_its_budget_back(monkeypatch) -> None:
    """The budget of bodies awaited is taken before the body's bytes are made: if making them
    fails, the share taken is given back (else every later large body would count it forever)."""

    def no_memory(received: Any, left: int) -> Any:
        raise MemoryError

    monkeypatch.setattr(data_connection, "body_with_room", no_memory)
    server = _server({})
    conn, _ = _connection(server)
    with pytest.raises(MemoryError):
        _read_into_buffers(conn, b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 * DIRECT))
    assert server.awaited_body_bytes == 0
