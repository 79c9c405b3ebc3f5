"""Slow clients: slowloris headers, a body that never arrives, and a reader that never reads."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import orjson
import pytest
from aiohttp import web

from .fakes import FakeUpstream
from .fault_ledger import ReplicaCounts, fake_counts

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def _closed_by_server(reader: asyncio.StreamReader, timeout: float) -> bool:
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="Slowloris: 50 connections dribbling header bytes",
    clients_saw="each closed by the router after server.client_header_timeout_s; other clients served normally",
)
async def test_slowloris_headers_are_bounded(start_app, start_router, fault_record):
    up = FakeUpstream()
    _, url = await start_router([await start_app(up.app())], server={"client_header_timeout_s": 1.0},
                                signals={"source": "health", "interval_s": 60})
    port = int(url.rsplit(":", 1)[1])
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(50)]

    async def dribble(writer: asyncio.StreamWriter) -> None:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        try:
            for i in range(100):  # one byte every 0.2 s: would take 20 s to finish a header
                writer.write(b"X"[:1])
                await writer.drain()
                await asyncio.sleep(0.2)
        except (ConnectionResetError, BrokenPipeError):
            pass

    dribblers = [asyncio.create_task(dribble(w)) for _, w in conns]
    async with aiohttp.ClientSession() as client:
        for _ in range(10):  # meanwhile, normal clients
            async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
                assert (await fault_record.observe(r)).kind == "complete"
            await asyncio.sleep(0.05)
    closed = await asyncio.gather(*(_closed_by_server(r, 10) for r, _ in conns))
    for t in dribblers:
        t.cancel()
    for _, w in conns:
        w.close()
    assert all(closed)
    fault_record.replica(fake_counts("replica", up))
    fault_record.note(f"{sum(closed)} of 50 slowloris connections, whose request headers never ended, "
                      "closed by the router; they are not counted as requests")


@pytest.mark.timeout(30)
async def test_idle_connection_without_a_request_is_closed(start_app, start_router):
    _, url = await start_router([await start_app(FakeUpstream().app())], server={"client_header_timeout_s": 0.5},
                                signals={"source": "health", "interval_s": 60})
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    assert await _closed_by_server(reader, 5)
    writer.close()


@pytest.mark.timeout(30)
async def test_header_timeout_spares_a_long_request_then_closes_its_idle_connection(start_app, start_router):
    """The header timeout bounds only the wait for a request: one served for longer than it is
    answered in full, and the keep-alive connection is closed once idle that long again."""
    up = FakeUpstream()
    up.hold_before_headers = asyncio.Event()
    _, url = await start_router([await start_app(up.app())], server={"client_header_timeout_s": 0.3},
                                signals={"source": "health", "interval_s": 60})
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    body = orjson.dumps(CHAT)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = asyncio.get_running_loop().time() + 10
    while not up.requests and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    # Held past three header timeouts (the connection's timer fires meanwhile), then answered.
    assert not await _closed_by_server(reader, 1.0)
    up.hold_before_headers.set()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    assert orjson.loads(await asyncio.wait_for(reader.readexactly(length), 10))["choices"]
    assert await _closed_by_server(reader, 5)  # idle again: closed after the header timeout
    writer.close()


@pytest.mark.timeout(30)
async def test_body_that_never_arrives_gets_408(start_app, start_router):
    up = FakeUpstream()
    _, url = await start_router([await start_app(up.app())], server={"client_body_timeout_s": 0.5},
                                signals={"source": "health", "interval_s": 60})
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\"")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    assert data.startswith(b"HTTP/1.1 408")
    assert b'"error"' in data
    assert not up.requests


EVENT = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"  # 64 KiB SSE events
TOTAL_EVENTS = 2048  # 128 MiB if nobody pushed back


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="Client that never reads its stream (128 MiB upstream response)",
    clients_saw="backpressure: the router stops reading the replica (bytes buffered bounded), other clients unaffected; replica sees the disconnect when the client goes",
)
async def test_reader_that_never_reads_is_backpressured(start_app, start_router, fault_record):
    progress = {"sent": 0, "closed": asyncio.Event()}
    counts = {"received": 0, "completed": 0, "aborted": 0}

    async def firehose(request: web.Request) -> web.StreamResponse:
        small = b'"small"' in await request.read()
        counts["received"] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if small:  # an ordinary client's short stream
            await resp.write(b"data: {}\n\ndata: [DONE]\n\n")
            counts["completed"] += 1
            return resp
        try:
            for _ in range(TOTAL_EVENTS):
                await resp.write(EVENT)
                progress["sent"] += len(EVENT)
        except (ConnectionResetError, asyncio.CancelledError):
            counts["aborted"] += 1
            progress["closed"].set()
            raise
        counts["completed"] += 1
        return resp

    hose = web.Application()
    hose.router.add_post("/v1/chat/completions", firehose)

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    hose.router.add_get("/health", health)
    hose_url = await start_app(hose)
    _, url = await start_router([hose_url], signals={"source": "health", "interval_s": 60})
    # A client with a tiny receive buffer that reads the headers and then nothing.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    reader, writer = await asyncio.open_connection(sock=sock)
    hog = fault_record.send("never reads")
    body = b'{"model": "m", "messages": [], "stream": true}'
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    reader._transport.pause_reading()  # type: ignore[attr-defined]  # and never read again
    # let the router and the replica run as far as backpressure lets them
    last = -1
    for _ in range(40):
        await asyncio.sleep(0.1)
        if progress["sent"] == last:
            break
        last = progress["sent"]
    stuck_at = progress["sent"]
    async with aiohttp.ClientSession() as client:  # other clients of the same router are unaffected
        for _ in range(3):
            async with client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True, "small": 1}) as r:
                assert (await fault_record.observe(r)).kind == "complete"
        async with client.get(url + "/health") as r:
            assert r.status == 200
    assert progress["sent"] < 32 * 1024 * 1024, progress["sent"]  # bounded, not 128 MiB
    assert progress["sent"] - stuck_at < 4 * 1024 * 1024  # and no longer growing
    writer.transport.abort()  # the client goes away: the replica's stream is cancelled
    hog.left()
    await asyncio.wait_for(progress["closed"].wait(), 10)
    fault_record.replica(ReplicaCounts("firehose", counts["received"], counts["completed"], counts["aborted"],
                                       running=counts["received"] - counts["completed"] - counts["aborted"]))
    fault_record.note(f"buffered {stuck_at / 2**20:.1f} MiB of 128 MiB before backpressure")


@pytest.mark.timeout(30)
async def test_client_that_stops_reading_a_stream_is_cut_and_its_slot_released(
        start_app, start_router, monkeypatch):
    """A client keeps its connection open and never reads: the router's writes block, reading
    from the replica pauses, so no idle timeout fires. Past the total timeout (plus the grace
    for an error event) the client's connection is cut and the replica's slot comes back."""
    from kvrouter.router import stream_relay as relay_module

    monkeypatch.setattr(relay_module, "_CLIENT_WRITE_GRACE_S", 0.5)
    event = b"data: " + b"x" * 4000 + b"\n\n"
    aborted = asyncio.Event()

    async def firehose(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(100_000):
                await resp.write(event)
        except (ConnectionResetError, asyncio.CancelledError):
            aborted.set()
            raise
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", firehose)
    app.router.add_get("/health", health)
    upstream = await start_app(app)
    router, url = await start_router([upstream], signals={"source": "health", "interval_s": 60},
                                     upstream={"total_timeout_s": 1.0, "idle_timeout_s": 1.0})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    reader, writer = await asyncio.open_connection(sock=sock)
    body = b'{"model": "m", "messages": [], "stream": true}'
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await reader.readuntil(b"\r\n\r\n")
    reader._transport.pause_reading()  # stop reading: the window closes
    try:
        await asyncio.wait_for(aborted.wait(), 10)  # the replica's connection was given up
        deadline = asyncio.get_running_loop().time() + 10
        while router.registry.view(upstream).in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert router.registry.view(upstream).in_flight == 0
    finally:
        writer.close()
