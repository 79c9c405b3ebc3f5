"""The data port's reads over a real loopback socket, under uvloop (what `kvrouter serve` runs)
and asyncio's own loop: large bodies read straight into buffers of their length, small requests
and pipelined ones parsed from the server's shared read buffer, all arriving byte-identical."""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import Callable

import pytest
import uvloop
from aiohttp import web

from kvrouter.router.data_http import Request
from kvrouter.router.data_server import DataServer
from kvrouter.router.middlewares import errors_middleware

MAX_BODY = 4 << 20
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


def _body(tag: int, size: int) -> bytes:
    return (b"<%d:" % tag + bytes(range(256)) * (size // 256 + 1))[:size]


def _request(body: bytes, close: bool = False) -> bytes:
    return (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n"
            % (len(body), b"Connection: close\r\n" if close else b"")) + body


async def _exchange(wire: list[bytes], answers: int) -> tuple[list[str], bytes]:
    """Serve /echo (the body's length and digest), send `wire` in those writes on one
    connection, and return what the handler saw and all the client read."""
    seen: list[str] = []

    async def echo(request: Request) -> web.Response:
        body = await request.read()
        assert type(body) is bytes
        digest = f"{len(body)} {hashlib.sha256(body).hexdigest()}"
        seen.append(digest)
        return web.Response(body=digest.encode())

    server = DataServer({"/echo": {"POST": echo}}, [errors_middleware(MAX_BODY)], [],
                        max_body_bytes=MAX_BODY, header_timeout_s=10, shutdown_grace_s=0)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for piece in wire:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0)  # so the server's reads end where the writes do, often
        received = b""
        async with asyncio.timeout(20):
            while _short(received, answers):
                chunk = await reader.read(65536)
                if not chunk:
                    break
                received += chunk
        writer.close()
    finally:
        await server.cleanup()
    return seen, received


def _short(received: bytes, answers: int) -> bool:
    """The last answer's body not yet all read (each is a `len digest` line of known size)."""
    last = received.rfind(b"HTTP/1.1 200 OK")
    if last < 0 or received.count(b"HTTP/1.1 200 OK") < answers:
        return True
    head_end = received.find(b"\r\n\r\n", last)
    if head_end < 0:
        return True
    length = int(received[last:head_end].split(b"Content-Length: ")[1].split(b"\r\n")[0])
    return len(received) < head_end + 4 + length


def _expected(*bodies: bytes) -> list[str]:
    return [f"{len(b)} {hashlib.sha256(b).hexdigest()}" for b in bodies]


@pytest.mark.parametrize("loop_name", list(LOOPS))
@pytest.mark.parametrize("split", ["whole", "head-apart", "odd-pieces"])
def test_large_and_small_pipelined_bodies_arrive_whole(loop_name: str, split: str) -> None:
    big, small, bigger = _body(1, 420_000), _body(2, 900), _body(3, 1_500_000)
    wire = _request(big) + _request(small) + _request(bigger)
    if split == "whole":
        pieces = [wire]
    elif split == "head-apart":  # each head in a write of its own, then its body
        pieces = []
        for body in (big, small, bigger):
            one = _request(body)
            head = len(one) - len(body)
            pieces += [one[:head], one[head:]]
    else:  # writes that end mid-head, mid-body and across requests
        cuts = [0, 17, 70_000, 70_001, 300_000, len(_request(big)) + 5, 600_000, 1_000_003, len(wire)]
        pieces = [wire[a:b] for a, b in zip(cuts, cuts[1:])]
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        seen, received = runner.run(_exchange(pieces, 3))
    assert seen == _expected(big, small, bigger)
    answers = [part.split(b"\r\n\r\n", 1)[1][:len(e)] for part, e in
               zip(received.split(b"HTTP/1.1 200 OK")[1:], seen)]
    assert [a.decode() for a in answers] == seen


@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_many_large_bodies_on_one_connection_reuse_nothing_of_each_other(loop_name: str) -> None:
    bodies = [_body(i, 70_000 + 9_001 * i) for i in range(6)]
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        seen, _ = runner.run(_exchange([_request(b) for b in bodies], len(bodies)))
    assert seen == _expected(*bodies)


@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_heads_without_their_bodies_set_aside_no_more_than_the_budget(
        loop_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads announcing large bodies that do not come set aside at most MAX_AWAITED_BODY_BYTES
    between them (past it a body is parsed as it comes); each body, once sent, still arrives
    whole, and a connection cut mid-body gives its share back."""
    from kvrouter.router import data_server as data_server_module
    monkeypatch.setattr(data_server_module, "MAX_AWAITED_BODY_BYTES", 1 << 20)
    bodies = [_body(i, 400_000) for i in range(4)]

    async def run() -> tuple[list[int], list[str], int]:
        seen: list[str] = []

        async def echo(request: Request) -> web.Response:
            body = await request.read()
            seen.append(f"{len(body)} {hashlib.sha256(body).hexdigest()}")
            return web.Response(body=b"ok")

        server = DataServer({"/echo": {"POST": echo}}, [errors_middleware(MAX_BODY)], [],
                            max_body_bytes=MAX_BODY, header_timeout_s=10, shutdown_grace_s=0)
        port = await server.start("127.0.0.1", 0)
        awaited: list[int] = []
        try:
            conns = []
            for n, body in enumerate(bodies, 1):  # each head and a first piece, no more, in turn
                conns.append(await asyncio.open_connection("127.0.0.1", port))
                conns[-1][1].write(_request(body)[:-len(body) + 1000])
                await conns[-1][1].drain()
                async with asyncio.timeout(10):
                    while len([c for c in server.connections if c._parsing is not None]) < n:
                        await asyncio.sleep(0.01)
            awaited.append(server.awaited_body_bytes)
            conns[0][1].close()  # one client goes away mid-body
            async with asyncio.timeout(10):
                while len(server.connections) > len(bodies) - 1:
                    await asyncio.sleep(0.01)
            awaited.append(server.awaited_body_bytes)
            for (reader, writer), body in zip(conns[1:], bodies[1:]):
                writer.write(body[1000:])
                await writer.drain()
                async with asyncio.timeout(10):
                    assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200 OK")
                writer.close()
            awaited.append(server.awaited_body_bytes)
        finally:
            await server.cleanup()
        return awaited, seen, len(bodies)

    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        awaited, seen, _ = runner.run(run())
    assert awaited == [2 * 399_000, 399_000, 0]  # the first two set aside, the others parsed as they come
    assert seen == _expected(*bodies[1:])
