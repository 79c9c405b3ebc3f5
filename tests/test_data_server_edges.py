"""The data port at the socket on the edges of HTTP/1.1: answers the server cannot write as
they are, request framing it must refuse, Expect on an oversized body, HTTP/1.0 keep-alive."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web
from multidict import CIMultiDict

from kvrouter.router.data_http import WholeResponse
from kvrouter.router.data_server import DataServer

from .fakes import FakeUpstream
from .test_data_server import CHAT, _open, _post, _read_all

ANSWER = b'{"id":"c","object":"chat.completion","choices":[]}'


async def test_a_replica_header_outside_latin_1_is_relayed_not_a_hang(start_app, start_router):
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json", headers={"X-Note": "€uro"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    _, url = await start_router([await start_app(app)])
    reader, writer = await _open(url)
    writer.write(_post(CHAT, b"Connection: close"))
    data = await _read_all(reader)
    writer.close()
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert "X-Note: €uro".encode() in data and data.endswith(ANSWER)


async def test_a_transfer_encoding_not_ending_in_chunked_is_a_json_400(start_app, start_router):
    _, url = await start_router([await start_app(FakeUpstream().app())])
    reader, writer = await _open(url)
    # No length can be known for such a body (RFC 9112 section 6.3): refused, never read to close.
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n" + CHAT)
    data = await _read_all(reader)
    writer.close()
    assert data.startswith(b"HTTP/1.1 400"), data[:200]
    assert orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == 400


async def test_expect_continue_on_a_body_over_the_limit_gets_413_without_100(start_app, start_router):
    _, url = await start_router([await start_app(FakeUpstream().app())], server={"max_body_bytes": 100})
    reader, writer = await _open(url)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                 b"Content-Length: 5000\r\n\r\n")
    data = await _read_all(reader)
    writer.close()
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"100 Continue" not in data


async def test_http_1_0_keep_alive_is_acknowledged_and_the_connection_reused(start_app, start_router):
    _, url = await start_router([await start_app(FakeUpstream().app())])
    reader, writer = await _open(url)
    writer.write(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    # A 1.0 client assumes the connection closes unless the answer says it stays open.
    assert head.startswith(b"HTTP/1.1 200") and b"connection: keep-alive" in head.lower(), head
    await reader.readexactly(len(b'{"status":"ok"}'))
    writer.write(b"GET /health HTTP/1.0\r\n\r\n")
    data = await _read_all(reader)
    writer.close()
    assert data.startswith(b"HTTP/1.1 200") and b"connection: close" in data.lower()


async def _get_x(handler, middlewares) -> bytes:
    """All a client reads for `GET /x` from a data server whose only route is `handler`."""
    server = DataServer({"/x": {"GET": handler}}, middlewares, [], max_body_bytes=1000,
                        header_timeout_s=5, shutdown_grace_s=0.1)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        data = await _read_all(reader)
        writer.close()
    finally:
        await server.cleanup()
    return data


async def test_an_answer_that_cannot_be_written_is_a_json_500_not_a_hang():
    async def broken(request):  # a header no encoding can carry (a lone surrogate)
        return WholeResponse(200, b"{}", CIMultiDict({"X-Bad": "\ud800"}))

    data = await _get_x(broken, [])
    assert data.startswith(b"HTTP/1.1 500"), data[:200]
    assert orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == 500


async def test_a_handler_failing_after_its_stream_head_went_out_ends_the_connection_not_a_second_answer():
    from kvrouter.router.data_http import StreamResponse
    from kvrouter.router.middlewares import errors_middleware

    async def fails_midway(request):
        response = StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        response.send_head()  # as the relay does while the replica prefills
        raise RuntimeError("a bug after the head went out")

    data = await _get_x(fails_midway, [errors_middleware(1000)])
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert data.count(b"HTTP/1.1") == 1, data  # no 500 inside the stream's body: the connection ends


async def test_a_pipelined_body_waiting_behind_a_slow_answer_is_not_buffered_whole():
    release = asyncio.Event()

    async def slow(request):
        await request.read()
        await release.wait()
        return WholeResponse(200, b"slow", CIMultiDict())

    async def upload(request):
        return WholeResponse(200, b"%d" % len(await request.read()), CIMultiDict())

    big = b"x" * (16 << 20)
    server = DataServer({"/slow": {"GET": slow}, "/up": {"POST": upload}}, [], [],
                        max_body_bytes=32 << 20, header_timeout_s=10, shutdown_grace_s=0.1)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /up HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                     % len(big))
        sending = asyncio.ensure_future(_send(writer, big))
        (conn,) = server.connections
        deadline = asyncio.get_running_loop().time() + 20
        while not conn._reading_paused and not sending.done() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert conn._reading_paused and conn._queue[0]._size < len(big) // 4
        release.set()
        await sending
        data = await _read_all(reader)
        writer.close()
    finally:
        release.set()
        await server.cleanup()
    assert data.count(b"HTTP/1.1 200") == 2 and data.endswith(b"%d" % len(big)), data[-200:]


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


async def test_a_relayed_204_carries_no_body_and_the_connection_stays_in_step(start_app, start_router):
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    _, url = await start_router([await start_app(app)])
    reader, writer = await _open(url)
    writer.write(_post(CHAT) + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = await _read_all(reader)
    writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 204"), data[:300]
    assert b"transfer-encoding" not in head.lower()
    assert rest.startswith(b"HTTP/1.1 200") and rest.endswith(b'{"status":"ok"}'), data[:300]


async def test_a_client_pipelining_without_reading_is_not_answered_into_memory():
    served = 0
    body = b"y" * (400 << 10)

    async def big(request):
        nonlocal served
        served += 1
        return WholeResponse(200, body, CIMultiDict())

    server = DataServer({"/big": {"GET": big}}, [], [], max_body_bytes=1000,
                        header_timeout_s=10, shutdown_grace_s=0.1)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 100)  # and reads nothing
        (conn,) = server.connections
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while served < 100 and conn._drain is None and loop.time() < deadline:
            await asyncio.sleep(0.01)
        # The answer written waits for the client to read before the next is served.
        assert conn._drain is not None and served < 100
        writer.close()
    finally:
        await server.cleanup()


async def test_a_malformed_chunked_body_is_a_prompt_json_400(start_app, start_router):
    # The body timeout is long: the answer must not wait for it.
    _, url = await start_router([await start_app(FakeUpstream().app())],
                                server={"client_body_timeout_s": 30})
    reader, writer = await _open(url)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"5\r\n{\"a\":\r\nzz\r\n")
    data = await _read_all(reader)
    writer.close()
    assert data.startswith(b"HTTP/1.1 400"), data[:200]
    error = orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]
    assert error["message"].startswith("malformed HTTP request"), error


async def test_the_body_of_a_request_answered_before_it_arrived_is_not_kept():
    seen = []

    async def refuse(request):  # answers without reading the body (as a 401 does)
        seen.append(request)
        return WholeResponse(401, b"{}", CIMultiDict())

    server = DataServer({"/x": {"POST": refuse, "GET": refuse}}, [], [], max_body_bytes=32 << 20,
                        header_timeout_s=10, shutdown_grace_s=0.1)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b"z" * (4 << 20)
        writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 401") and b"Connection: close" not in head
        await reader.readexactly(2)
        # The connection stays in step: the body is read past, then the next request served.
        writer.write(body + b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = await _read_all(reader)
        writer.close()
    finally:
        await server.cleanup()
    assert data.startswith(b"HTTP/1.1 401") and len(seen) == 2
    assert seen[0]._chunks == [], "a body nobody will read was buffered"


async def test_more_headers_than_the_cap_is_a_json_431(start_app, start_router):
    _, url = await start_router([await start_app(FakeUpstream().app())])
    reader, writer = await _open(url)
    many = b"".join(b"X-%d: v\r\n" % i for i in range(200))  # small, but too many
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    data = await _read_all(reader)
    writer.close()
    assert data.startswith(b"HTTP/1.1 431"), data[:200]
    assert orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]["type"] == "request_too_large"


async def test_a_single_valued_header_sent_twice_is_a_json_400_in_any_case(start_app, start_router):
    upstream = FakeUpstream()
    _, url = await start_router([await start_app(upstream.app())])
    for twice in (b"Content-Type: application/json\r\ncontent-TYPE: text/plain",
                  b"Authorization: Bearer a\r\nauthorization: Bearer b",
                  b"User-Agent: a\r\nUser-Agent: a"):
        reader, writer = await _open(url)
        writer.write(_post(CHAT, twice))
        data = await _read_all(reader)  # answered, then the connection closes
        writer.close()
        assert data.startswith(b"HTTP/1.1 400"), data[:200]
        error = orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]
        assert "duplicate" in error["message"] and twice.split(b":")[0].decode().lower() \
            in error["message"].lower()
    # repeats of a field that may carry several values are kept, and the request served
    reader, writer = await _open(url)
    writer.write(_post(CHAT, b"Accept: a\r\nAccept: b", b"Connection: close"))
    data = await _read_all(reader)
    writer.close()
    assert data.startswith(b"HTTP/1.1 200"), data[:200]


async def test_a_header_line_that_never_ends_is_a_json_431_not_held_in_memory():
    # The parser hands a header over only once its line ends: the caps on each header are
    # checked then, so the bytes of an unfinished head are bounded as they arrive.
    async def echo(request):
        return WholeResponse(200, b"{}", CIMultiDict({"Content-Type": "application/json"}))

    server = DataServer({"/x": {"GET": echo}}, [], [], max_body_bytes=1000,
                        header_timeout_s=30, shutdown_grace_s=0.1)
    port = await server.start("127.0.0.1", 0)
    try:
        for start in (b"GET /x HTTP/1.1\r\nHost: a\r\nX-Big: ", b"GET /x HTTP/1.1\r\nHost: a\r\nX-"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answer = asyncio.ensure_future(reader.read(65536))  # read as it comes: the server
            writer.write(start)  # closes on what it has not read, which may reset the connection
            try:
                for _ in range(64):  # 4 MiB of one header's value (or name), never ended
                    if answer.done():
                        break
                    writer.write(b"a" * 65536)
                    await writer.drain()
            except ConnectionError:
                pass  # refused part way: what the server must do
            data = await asyncio.wait_for(answer, 10)
            writer.close()
            assert data.startswith(b"HTTP/1.1 431") and b'"request_too_large"' in data, data[:200]
        # a head within the caps, arriving in small pieces, is still served
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"GET /x HTTP/1.1\r\nHost: a\r\n" + b"".join(
            b"X-H%d: %s\r\n" % (i, b"v" * 500) for i in range(120)) + b"Connection: close\r\n\r\n"
        for at in range(0, len(head), 1024):
            writer.write(head[at:at + 1024])
            await writer.drain()
            await asyncio.sleep(0)
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
    finally:
        await server.cleanup()


def test_the_declared_multidict_intersects_header_names_case_insensitively():
    # The data port finds repeated single-valued request headers, and the framing fields of an
    # answer, by intersecting a CIMultiDict's keys with lower-case names: case-insensitive only
    # from multidict 6.3 (aiohttp accepts older ones), so that floor must be declared.
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    floors = [re.fullmatch(r"multidict\s*>=\s*(\d+)\.(\d+)(?:\.\d+)?", d.split(";")[0].strip())
              for d in project["project"]["dependencies"] if d.startswith("multidict")]
    assert floors and floors[0] is not None and (int(floors[0][1]), int(floors[0][2])) >= (6, 3), floors
    assert CIMultiDict([("Content-TYPE", "a")]).keys() & {"content-type"}


async def test_a_replica_s_utf8_header_value_goes_back_as_its_own_bytes() -> None:
    """Replica header values are decoded as UTF-8 (undecodable bytes escaped): the answer's head
    carries the replica's bytes, not a latin-1 byte for a character that fits in one."""
    server = DataServer({}, [], [], max_body_bytes=1, header_timeout_s=60, shutdown_grace_s=0)
    server.loop = asyncio.get_running_loop()
    replica_bytes = b"caf\xc3\xa9"
    value = replica_bytes.decode("utf-8", "surrogateescape")
    head = server.head(200, CIMultiDict([("X-Model", value)]), b"", True)
    assert b"\r\nX-Model: " + replica_bytes + b"\r\n" in head
