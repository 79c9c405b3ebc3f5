"""The relay's HTTP/1.1 client (router/upstream_http.py) against real servers on 127.0.0.1:
aiohttp apps for well-formed replicas, raw asyncio servers for the malformed and the broken."""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from multidict import CIMultiDict

from kvrouter.router.upstream_http import (
    UpstreamBodyError,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamTimeout,
)

JSON = CIMultiDict({"Content-Type": "application/json"})
CHUNK_ABC = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[RawHandler], Awaitable[str]]]:
    """A TCP server that answers with whatever bytes the test writes."""
    servers: list[asyncio.Server] = []

    async def _start(handler: RawHandler) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield _start
    for server in servers:
        server.close()


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    """A pool with a 2 s connect and 10 s total timeout, closed after the test."""
    p = UpstreamPool(2, 10)
    yield p
    await p.close()


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head, await reader.readexactly(length)


async def chunk_then_wait(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A replica that starts a chunked body, then sends nothing until the router hangs up."""
    await _read_request(reader)
    writer.write(CHUNK_ABC)
    await writer.drain()
    await reader.read()


def one_route(path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    app = web.Application()
    app.router.add_post(path, handler)
    return app


def echo_app(peers: list[object]) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return web.Response(body=await request.read(), headers={
            "X-Path": request.path_qs, "X-Host": request.host, "X-Seen": request.headers.get("X-Test", ""),
        })

    return one_route("/{tail:.*}", echo)


async def test_keep_alive_reuse_path_prefix_and_headers(start_app, pool: UpstreamPool) -> None:
    peers: list[object] = []
    url = await start_app(echo_app(peers))
    for i in range(3):
        headers = CIMultiDict({"X-Test": f"t{i}"})
        resp = await pool.request("POST", url + "/prefix", "/v1/chat?x=1", headers, b"body%d" % i)
        assert resp.status == 200
        assert await resp.read() == b"body%d" % i
        assert resp.headers["X-Path"] == "/prefix/v1/chat?x=1"
        assert resp.headers["X-Host"] == url.removeprefix("http://")
        assert resp.headers["X-Seen"] == f"t{i}"
        assert resp.content_length == len(b"body0")
        resp.close()
    assert len(set(peers)) == 1  # one connection, kept alive
    assert len(pool.connections()) == 1


async def test_chunked_streaming_arrives_piece_by_piece(start_app, pool: UpstreamPool) -> None:
    release = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await release.wait()
        await resp.write(b"data: 2\n\n")
        await resp.write_eof()
        return resp

    url = await start_app(one_route("/s", stream))
    resp = await pool.request("POST", url, "/s", JSON, b"{}")
    assert resp.content_type == "text/event-stream"
    assert resp.content_length is None
    assert await resp.readany() == b"data: 1\n\n"  # before the server sends the rest
    release.set()
    assert await resp.read() == b"data: 2\n\n"
    resp.close()
    assert len(pool.connections()) == 1  # chunked end seen: reusable


async def test_body_ended_by_close_informational_skipped(raw_server, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"a\":")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"1}")
        writer.close()

    url = await raw_server(handler)
    resp = await pool.request("POST", url, "/", JSON, b"{}")
    assert resp.status == 200
    assert await resp.read() == b'{"a":1}'
    resp.close()
    assert pool.connections() == []


async def test_stale_idle_connection_is_retried_once_on_a_new_one(raw_server, pool: UpstreamPool) -> None:
    """The replica closes a kept-alive connection just as the next request is written: nothing
    was answered, so the request goes again on a fresh connection (and is answered once)."""
    served = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await _read_request(reader)
        served.append(body)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await _read_request(reader)  # the next request on this connection: drop it unanswered
        writer.transport.abort()

    url = await raw_server(handler)
    for body in (b"1", b"2"):
        resp = await pool.request("POST", url, "/", JSON, body)
        assert await resp.read() == b"ok"
        resp.close()
    assert served == [b"1", b"2"]


async def test_refused_and_garbled_responses_are_connect_errors(raw_server, closed_port_url, pool: UpstreamPool) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async def upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
        await writer.drain()

    with pytest.raises(UpstreamConnectError):
        await pool.request("POST", closed_port_url, "/", JSON, b"{}")
    for handler in (garbage, upgrade):
        with pytest.raises(UpstreamConnectError):
            await pool.request("POST", await raw_server(handler), "/", JSON, b"{}")


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n",  # shorter than announced
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n",  # ends at close: a reset is no end
])
async def test_break_mid_body_keeps_received_bytes_then_raises(raw_server, head: bytes, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(head + b"partial-")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()  # RST, not FIN: the body did not end, it broke

    resp = await pool.request("POST", await raw_server(handler), "/", JSON, b"{}")
    assert await resp.readany() == b"partial-"
    with pytest.raises(UpstreamBodyError):
        await resp.readany()
    resp.close()


async def test_total_timeout_before_headers_and_in_the_body(raw_server) -> None:
    hang = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await hang.wait()

    pool = UpstreamPool(2, 0.3)
    try:
        with pytest.raises(asyncio.TimeoutError):
            await pool.request("POST", await raw_server(silent), "/", JSON, b"{}")
        resp = await pool.request("POST", await raw_server(chunk_then_wait), "/", JSON, b"{}")
        assert await resp.readany() == b"abc"
        with pytest.raises(asyncio.TimeoutError):
            await resp.readany()
        resp.close()
        assert pool.connections() == []
    finally:
        hang.set()
        await pool.close()


async def test_header_idle_and_total_timeouts_are_told_apart(raw_server) -> None:
    """Each missed deadline raises UpstreamTimeout with its kind and closes the connection."""
    hang = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await hang.wait()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while not hang.is_set():  # never idle, never done
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)

    quick_headers = UpstreamPool(2, 30, header_timeout_s=0.3, idle_timeout_s=0.3)
    short_total = UpstreamPool(2, 0.5, header_timeout_s=30, idle_timeout_s=30)
    try:
        with pytest.raises(UpstreamTimeout) as err:
            await quick_headers.request("POST", await raw_server(silent), "/", JSON, b"{}")
        assert err.value.kind == "header_timeout"
        resp = await quick_headers.request("POST", await raw_server(chunk_then_wait), "/", JSON, b"{}")
        assert await resp.readany() == b"abc"
        with pytest.raises(UpstreamTimeout) as err:
            await resp.readany()
        assert err.value.kind == "idle_timeout"
        resp.close()
        with pytest.raises(UpstreamTimeout) as err:
            await short_total.request("POST", await raw_server(silent), "/", JSON, b"{}")
        assert err.value.kind == "total_timeout"
        resp = await short_total.request("POST", await raw_server(endless), "/", JSON, b"{}")
        with pytest.raises(UpstreamTimeout) as err:
            await asyncio.wait_for(resp.read(), 10)
        assert err.value.kind == "total_timeout"
        resp.close()
        assert quick_headers.connections() == [] and short_total.connections() == []
    finally:
        hang.set()
        await quick_headers.close()
        await short_total.close()


async def test_a_slow_but_steady_body_outlives_the_idle_timeout(raw_server) -> None:
    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n")
        for _ in range(12):
            await asyncio.sleep(0.1)
            writer.write(b"x")
            await writer.drain()

    pool = UpstreamPool(2, 30, header_timeout_s=5, idle_timeout_s=0.5)
    try:
        resp = await pool.request("POST", await raw_server(drip), "/", JSON, b"{}")
        assert await asyncio.wait_for(resp.read(), 20) == b"x" * 12
        resp.close()
    finally:
        await pool.close()


async def test_idle_timeout_counts_from_late_headers(raw_server) -> None:
    """Headers that took longer than the idle timeout (a long queue): a body that then stalls
    still times out one idle timeout later, not at the far later header deadline."""
    async def late_then_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(0.6)
        writer.write(CHUNK_ABC)
        await writer.drain()
        await reader.read()

    pool = UpstreamPool(2, 600, header_timeout_s=120, idle_timeout_s=0.3)
    try:
        resp = await pool.request("POST", await raw_server(late_then_silent), "/", JSON, b"{}")
        assert await resp.readany() == b"abc"
        with pytest.raises(UpstreamTimeout) as err:
            await asyncio.wait_for(resp.readany(), 10)  # bounded far below the header deadline
        assert err.value.kind == "idle_timeout"
        resp.close()
    finally:
        await pool.close()


async def test_a_reader_paused_by_back_pressure_is_not_idle(start_app) -> None:
    """While the relay's client reads slowly, reading from the replica is paused: that silence
    is the router's own and must not time the replica out."""
    piece = b"x" * 65536

    async def big(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(64):  # 4 MiB: far above the 1 MiB high-water mark
            await resp.write(piece)
        await resp.write_eof()
        return resp

    pool = UpstreamPool(2, 30, header_timeout_s=5, idle_timeout_s=0.3)
    try:
        resp = await pool.request("POST", await start_app(one_route("/big", big)), "/big", JSON, b"{}")
        await asyncio.sleep(0.8)  # not reading: the socket is paused for longer than idle_timeout_s
        assert len(await resp.read()) == 64 * len(piece)
        resp.close()
    finally:
        await pool.close()


async def test_cancelled_wait_aborts_the_replica_connection(raw_server, pool: UpstreamPool) -> None:
    """A client gone while the replica thinks: the replica's connection is closed (it stops)."""
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # returns at EOF: the router hung up
        closed.set()

    task = asyncio.create_task(pool.request("POST", await raw_server(handler), "/", JSON, b"{}"))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(closed.wait(), 5)


async def test_unread_large_body_pauses_the_replica(start_app) -> None:
    """Back-pressure: a reader that stops reading stops the socket reads too, so a fast replica
    cannot fill the router's memory; reading again resumes it."""
    piece = b"x" * 65536

    async def big(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(64):  # 4 MiB
            await resp.write(piece)
        await resp.write_eof()
        return resp

    url = await start_app(one_route("/big", big))
    pool = UpstreamPool(2, 30)
    try:
        resp = await pool.request("POST", url, "/big", JSON, b"{}")
        await asyncio.sleep(0.3)  # the replica writes as fast as it can meanwhile
        first = await resp.readany()
        assert 0 < len(first) <= 2 * (1 << 20)  # paused near the 1 MiB high-water mark
        assert len(first) + len(await resp.read()) == 64 * len(piece)
        resp.close()
    finally:
        await pool.close()


async def test_line_breaks_in_header_values_are_refused(start_app, pool: UpstreamPool) -> None:
    url = await start_app(echo_app([]))
    for value in ("a\r\nX-Smuggled: 1", "a\nb", "a\rb"):
        with pytest.raises(ValueError):
            await pool.request("POST", url, "/", CIMultiDict({"X-Test": value}), b"{}")


async def test_nodelay_on_replica_connections(start_app, pool: UpstreamPool) -> None:
    url = await start_app(echo_app([]))
    resp = await pool.request("POST", url, "/", JSON, b"{}")
    await resp.read()
    socks = [t.get_extra_info("socket") for t in pool.connections()]
    assert socks and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks)
    resp.close()


async def test_the_query_reaches_the_replica_as_the_client_encoded_it(start_app, start_router) -> None:
    seen: list[str] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(request.raw_path)
        return web.json_response({"ok": True})

    replica = await start_app(one_route("/v1/chat/completions", chat))
    router, url = await start_router([replica], signals={"source": "health", "interval_s": 60})
    import aiohttp
    from yarl import URL

    async with aiohttp.ClientSession() as client:
        for query in ("a=b%20c", "d=%0d%0aX-Evil:1", "e=%23%3F%C3%A9"):
            target = URL(url + "/v1/chat/completions?" + query, encoded=True)
            async with client.post(target, json={"model": "m", "messages": []}) as resp:
                assert resp.status == 200, await resp.text()
    assert seen == ["/v1/chat/completions?" + q for q in ("a=b%20c", "d=%0d%0aX-Evil:1", "e=%23%3F%C3%A9")]


async def test_closing_the_pool_ends_a_waiting_reader(raw_server) -> None:
    pool = UpstreamPool(2, 30)
    resp = await pool.request("POST", await raw_server(chunk_then_wait), "/", JSON, b"{}")
    assert await resp.readany() == b"abc"
    waiting = asyncio.create_task(resp.readany())
    await asyncio.sleep(0.05)
    await pool.close()
    with pytest.raises(UpstreamBodyError):
        await asyncio.wait_for(waiting, 5)


async def test_bytes_after_the_response_are_not_body_and_end_the_connection(raw_server, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
                     b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc")
        await writer.drain()
        await reader.read()

    resp = await pool.request("POST", await raw_server(handler), "/", JSON, b"{}")
    assert await resp.read() == b"hello"
    resp.close()
    await asyncio.sleep(0.05)
    assert pool.connections() == []  # not pooled: it is out of step with the replica


def test_host_header_of_ipv6_and_default_ports() -> None:
    pool = UpstreamPool(2, 10)
    assert pool._base("http://[::1]:8000")[1] == "[::1]:8000"
    assert pool._base("https://replica.example/prefix")[1:] == ("replica.example", "/prefix")
    assert pool._base("http://127.0.0.1:80")[1] == "127.0.0.1"


async def test_https_replica(tmp_path) -> None:
    import ssl

    import trustme

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    runner = web.AppRunner(echo_app([]))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    pool = UpstreamPool(2, 10, ssl_context=client_ctx)
    try:
        url = f"https://127.0.0.1:{runner.addresses[0][1]}"
        for body in (b"one", b"two"):
            resp = await pool.request("POST", url, "/x", JSON, body)
            assert resp.status == 200 and await resp.read() == body
            resp.close()
        assert len(pool.connections()) == 1
        with pytest.raises(UpstreamConnectError):  # the system trust store does not know the CA
            await UpstreamPool(2, 10).request("POST", url, "/x", JSON, b"{}")
    finally:
        await pool.close()
        await runner.cleanup()


async def test_a_pooled_connection_keeps_its_deadlines_across_exchanges(raw_server) -> None:
    """One keep-alive connection: an idle spell in the pool longer than the header and idle
    timeouts ends nothing (nothing is due between exchanges), and the next exchange on it still
    times out when its replica goes silent."""
    hang = asyncio.Event()
    connections = 0

    async def answers_twice_then_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        for _ in range(2):
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        await _read_request(reader)
        await hang.wait()

    pool = UpstreamPool(2, 30, header_timeout_s=0.3, idle_timeout_s=0.3)
    try:
        url = await raw_server(answers_twice_then_silent)
        resp = await pool.request("POST", url, "/", JSON, b"{}")
        assert await resp.read() == b"ok"
        resp.close()
        await asyncio.sleep(0.5)  # idle in the pool past both timeouts
        assert len(pool.connections()) == 1
        resp = await pool.request("POST", url, "/", JSON, b"{}")
        assert await resp.read() == b"ok"
        resp.close()
        with pytest.raises(UpstreamTimeout) as err:
            await asyncio.wait_for(pool.request("POST", url, "/", JSON, b"{}"), 10)
        assert err.value.kind == "header_timeout"
        assert connections == 1 and pool.connections() == []
    finally:
        hang.set()
        await pool.close()


async def test_a_pooled_connection_the_replica_closes_is_not_kept_by_its_timer(raw_server) -> None:
    """A replica closing a kept-alive connection while it idles in the pool: the connection
    is let go at once, not held until its last exchange's deadline check would have come."""
    closed = asyncio.Event()

    async def answers_then_closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        closed.set()

    pool = UpstreamPool(2, 30)
    try:
        url = await raw_server(answers_then_closes)
        resp = await pool.request("POST", url, "/", JSON, b"{}")
        assert await resp.read() == b"ok"
        (conn,) = pool._open
        gone = weakref.ref(conn)
        resp.close()
        del resp, conn
        await closed.wait()
        async with asyncio.timeout(5):
            while pool.connections():
                await asyncio.sleep(0.01)
        await asyncio.sleep(0)  # (the transport lets go of its protocol after connection_lost)
        gc.collect()
        assert gone() is None
    finally:
        await pool.close()


async def test_a_kept_timer_neither_ends_a_steady_stream_nor_spares_a_stalled_one(raw_server) -> None:
    """The next exchange starts before the last one's deadline check has come (the connection
    keeps that timer): a stream with gaps under the idle timeout runs on past it, and the one
    after, stalled mid-body, still times out."""
    async def three_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(6):
            await asyncio.sleep(0.15)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await _read_request(reader)
        writer.write(CHUNK_ABC)  # then nothing more
        await writer.drain()
        await reader.read()

    pool = UpstreamPool(2, 30, header_timeout_s=0.3, idle_timeout_s=0.3)
    try:
        url = await raw_server(three_answers)
        resp = await pool.request("POST", url, "/", JSON, b"{}")
        assert await resp.read() == b"ok"
        resp.close()
        resp = await pool.request("POST", url, "/", JSON, b"{}")  # at once: the timer is kept
        assert await asyncio.wait_for(resp.read(), 10) == b"x" * 6
        resp.close()
        resp = await pool.request("POST", url, "/", JSON, b"{}")
        assert await resp.readany() == b"abc"
        with pytest.raises(UpstreamTimeout) as err:
            await asyncio.wait_for(resp.read(), 10)
        assert err.value.kind == "idle_timeout"
        resp.close()
    finally:
        await pool.close()


async def test_response_headers_keep_names_values_repeats_and_utf8(raw_server, pool) -> None:
    """The head's fields arrive as sent: each name's case, UTF-8 values (as aiohttp decodes
    them), a repeated field twice, an empty value; `names` holds them lower-cased."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Model: caf\u00e9 \u2713\r\n"
                     "set-cookie: a=1\r\nSet-Cookie: b=2\r\nX-Empty:\r\n\r\nok".encode())
        await writer.drain()

    url = await raw_server(answer)
    resp = await pool.request("POST", url, "/v1/chat/completions", JSON, b"{}")
    assert list(resp.headers.items()) == [("Content-Length", "2"), ("X-Model", "caf\u00e9 \u2713"),
                                          ("set-cookie", "a=1"), ("Set-Cookie", "b=2"), ("X-Empty", "")]
    assert resp.names == {"content-length", "x-model", "set-cookie", "x-empty"}
    assert await resp.read() == b"ok"
    resp.close()


async def test_a_response_without_header_fields(raw_server, pool) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    url = await raw_server(answer)
    resp = await pool.request("POST", url, "/x", JSON, b"{}")
    assert resp.status == 204 and not resp.headers and resp.names == frozenset()
    resp.close()


def test_a_request_head_carries_the_client_s_header_bytes() -> None:
    """The data port decodes a client's header fields as latin-1; the replica gets those bytes
    back, not their UTF-8 encoding."""
    from kvrouter.router.upstream_http import _serialize

    client_bytes = b"\xe9t\xe9 caf\xc3\xa9"
    head = _serialize("POST", "/v1/x", "r:1", CIMultiDict([("X-Latin", client_bytes.decode("latin-1"))]), b"{}")
    assert b"\r\nX-Latin: " + client_bytes + b"\r\n" in head
