"""The data port's HTTP/1.1 server at the socket: connection reuse and closing, pipelined
requests answered in order, HEAD, 404/405 with Allow, and a body limit answered 413."""

from __future__ import annotations

import asyncio

import orjson

from .fakes import FakeUpstream

CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
STREAM = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'


def _post(body: bytes, *extra: bytes) -> bytes:
    head = [b"POST /v1/chat/completions HTTP/1.1", b"Host: x", b"Content-Type: application/json",
            b"Content-Length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def _open(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything until the router closes the connection (bounded)."""
    return await asyncio.wait_for(reader.read(), 10)


async def test_a_streamed_answer_to_connection_close_ends_with_the_connection(start_app, start_router):
    _, url = await start_router([await start_app(FakeUpstream().app())])
    reader, writer = await _open(url)
    writer.write(_post(STREAM, b"Connection: close"))
    data = await _read_all(reader)  # returns only once the router closes
    writer.close()
    assert data.startswith(b"HTTP/1.1 200") and b"connection: close" in data.lower()
    assert data.endswith(b"0\r\n\r\n") and b"[DONE]" in data


async def test_pipelined_requests_are_answered_in_order_on_one_connection(start_app, start_router):
    _, url = await start_router([await start_app(FakeUpstream().app())])
    reader, writer = await _open(url)
    # Three requests in one write: a stream, a plain answer, then /health closing the connection.
    writer.write(_post(STREAM) + _post(CHAT) + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = await _read_all(reader)
    writer.close()
    answers = data.split(b"HTTP/1.1 ")[1:]
    assert [a[:3] for a in answers] == [b"200", b"200", b"200"], data
    assert b"text/event-stream" in answers[0] and answers[0].endswith(b"0\r\n\r\n")
    assert b"chat.completion" in answers[1] and b"text/event-stream" not in answers[1]
    assert answers[2].endswith(b'{"status":"ok"}')


async def test_head_unknown_routes_and_wrong_methods(start_app, start_router):
    _, url = await start_router([await start_app(FakeUpstream().app())])
    reader, writer = await _open(url)
    writer.write(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 15" in head
    writer.write(b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 404")  # HEAD sent no body: the next answer follows at once
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    assert orjson.loads(await reader.readexactly(length))["error"]["code"] == 404
    writer.write(b"DELETE /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = await _read_all(reader)
    writer.close()
    assert data.startswith(b"HTTP/1.1 405") and b"Allow: GET,HEAD" in data
    assert orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == 405


async def test_a_body_over_the_limit_is_a_json_413_and_the_connection_closes(start_app, start_router):
    _, url = await start_router([await start_app(FakeUpstream().app())], server={"max_body_bytes": 100})
    reader, writer = await _open(url)
    body = b'{"model":"m","prompt":"' + b"x" * 200 + b'"}'
    writer.write(_post(body).replace(b"/v1/chat/completions", b"/v1/completions"))
    data = await _read_all(reader)
    writer.close()
    assert data.startswith(b"HTTP/1.1 413")
    assert orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]["type"] == "request_too_large"


async def test_an_upgrade_request_is_answered_plainly_then_the_connection_closes(start_app, start_router):
    _, url = await start_router([await start_app(FakeUpstream().app())])
    reader, writer = await _open(url)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
    data = await _read_all(reader)  # the bytes after an upgrade are not HTTP: nothing more is read
    writer.close()
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b'{"status":"ok"}')


async def test_malformed_requests_are_json_errors_and_close_the_connection(start_app, start_router):
    _, url = await start_router([await start_app(FakeUpstream().app())])
    cases = [
        (_post(CHAT, b"Content-Type: application/json"), 400),  # a single-valued header twice
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
    ]
    for raw, status in cases:
        reader, writer = await _open(url)
        writer.write(raw)
        data = await _read_all(reader)  # returns only once the router closes
        writer.close()
        assert data.startswith(b"HTTP/1.1 %d" % status), data[:200]
        error = orjson.loads(data.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == status and error["message"].startswith("malformed HTTP request")
