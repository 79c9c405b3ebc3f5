"""A request body as it reaches the data port: with its head, split exactly at the head's end,
in chunks, behind `Expect: 100-continue`, empty, or short of its Content-Length. Each is read
whole (or refused) the same way, with or without waiting for more bytes."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from .fakes import FakeUpstream

CHAT = orjson.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, dict]:
    """One whole answer: its status line and its JSON body."""
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        while head.startswith(b"HTTP/1.1 100"):
            head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return head.split(b"\r\n")[0], orjson.loads(await reader.readexactly(length))


@pytest.fixture
async def router(start_app, start_router):
    up = FakeUpstream()
    _, url = await start_router([await start_app(up.app())], server={"client_body_timeout_s": 0.5},
                                signals={"source": "health", "interval_s": 60})
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    yield up, reader, writer
    writer.close()


async def test_bodies_whole_split_at_the_head_and_chunked_are_each_relayed(router):
    up, reader, writer = router
    length = b"Content-Length: %d\r\n\r\n" % len(CHAT)
    writer.write(HEAD + length + CHAT)  # the body with its head
    status, body = await _answer(reader)
    assert status == b"HTTP/1.1 200 OK" and body["choices"]
    writer.write(HEAD + length)  # split exactly at the head's end
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(CHAT)
    status, body = await _answer(reader)
    assert status == b"HTTP/1.1 200 OK" and body["choices"]
    half = len(CHAT) // 2
    writer.write(HEAD + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (half, CHAT[:half]))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT) - half, CHAT[half:]))
    status, body = await _answer(reader)
    assert status == b"HTTP/1.1 200 OK" and body["choices"]
    assert len(up.requests) == 3


async def test_expect_continue_gets_100_then_the_body_is_read(router):
    up, reader, writer = router
    writer.write(HEAD + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(CHAT))
    async with asyncio.timeout(10):
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(CHAT)
    status, body = await _answer(reader)
    assert status == b"HTTP/1.1 200 OK" and body["choices"]


async def test_an_empty_body_is_a_json_400(router):
    up, reader, writer = router
    writer.write(HEAD + b"Content-Length: 0\r\n\r\n")
    status, body = await _answer(reader)
    assert status.startswith(b"HTTP/1.1 400") and body["error"]
    assert not up.requests


async def test_a_body_short_of_its_content_length_is_a_json_408(router):
    up, reader, writer = router
    writer.write(HEAD + b"Content-Length: %d\r\n\r\n" % (len(CHAT) + 1) + CHAT)
    status, body = await _answer(reader)
    assert status.startswith(b"HTTP/1.1 408") and body["error"]
    assert not up.requests


def _large_chat(tag: str, size: int) -> bytes:
    return orjson.dumps({"model": "fake-model", "messages": [
        {"role": "user", "content": f"{tag} " + "é long text " * (size // 13)}]})


def _count_parser_feeds(monkeypatch) -> list[int]:
    """Make the data port's connections count the bytes they feed their HTTP parser: the list
    each feed's size is appended to (connections made after this call)."""
    import httptools

    from kvrouter.router import data_connection

    fed: list[int] = []

    class CountingParser(httptools.HttpRequestParser):
        def feed_data(self, data: bytes) -> None:
            fed.append(len(data))
            super().feed_data(data)

    monkeypatch.setattr(data_connection.httptools, "HttpRequestParser", CountingParser)
    return fed


async def test_large_bodies_in_pieces_with_the_next_request_behind_reach_the_replica_whole(
        router, monkeypatch):
    """A large Content-Length body is taken from the reads past the HTTP parser: it still
    arrives byte for byte, split anywhere, and what follows it (the next request, pipelined in
    the same write) is parsed as a request."""
    fed = _count_parser_feeds(monkeypatch)
    up, _, connected = router
    port = connected.get_extra_info("peername")[1]  # a new connection gets the patched parser
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    first, second = _large_chat("first", 300_000), _large_chat("second", 200_000)
    requests = b"".join(HEAD + b"Content-Length: %d\r\n\r\n" % len(b) + b for b in (first, second, CHAT))
    for at in range(0, len(requests), 70_001):  # pieces that split heads and bodies anywhere
        writer.write(requests[at:at + 70_001])
        await writer.drain()
        await asyncio.sleep(0.01)
    for _ in range(3):
        status, body = await _answer(reader)
        assert status == b"HTTP/1.1 200 OK" and body["choices"]
    writer.close()
    assert [r["raw"] for r in up.requests[-3:]] == [first, second, CHAT]
    assert sum(fed) < len(requests) - 300_000  # most of the large bodies never went through it


async def test_a_large_body_is_fed_to_the_parser_no_further_than_its_first_read(router, monkeypatch):
    """A write that holds a request's head and a large body: the parser gets at most the first
    read (into the server's shared read buffer; it copies the body bytes there into pieces of
    its own), the rest of the body is read past it, and the body still reaches the replica byte
    for byte, with the request behind it in the same write parsed as one."""
    from kvrouter.router.data_limits import READ_BUFFER_BYTES

    fed = _count_parser_feeds(monkeypatch)
    up, _, connected = router
    port = connected.get_extra_info("peername")[1]  # a new connection gets the patched parser
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    large = _large_chat("large", 150_000)
    head = HEAD + b"Content-Length: %d\r\n\r\n" % len(large)
    writer.write(head + large + HEAD + b"Content-Length: %d\r\n\r\n" % len(CHAT) + CHAT)
    for _ in range(2):
        status, body = await _answer(reader)
        assert status == b"HTTP/1.1 200 OK" and body["choices"]
    writer.close()
    assert [r["raw"] for r in up.requests[-2:]] == [large, CHAT]
    assert fed[0] <= READ_BUFFER_BYTES
    assert sum(fed) < READ_BUFFER_BYTES + 2 * len(head) + len(CHAT) + 1000


async def test_requests_pipelined_behind_a_small_one_in_one_large_write_reach_the_replica_whole(router):
    """One large write that begins with a request whose body is short, then a chunked body,
    a large Content-Length one and a short one: a read that begins a request with much behind
    it has its head split off for the parser, and every body still arrives byte for byte."""
    up, reader, writer = router
    chunked, large = _large_chat("chunked", 90_000), _large_chat("large", 150_000)
    third = len(chunked) // 3
    pieces = (chunked[:third], chunked[third:])
    writer.write(HEAD + b"Content-Length: %d\r\n\r\n" % len(CHAT) + CHAT
                 + HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
                 + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
                 + HEAD + b"Content-Length: %d\r\n\r\n" % len(large) + large
                 + HEAD + b"Content-Length: %d\r\n\r\n" % len(CHAT) + CHAT)
    for _ in range(4):
        status, body = await _answer(reader)
        assert status == b"HTTP/1.1 200 OK" and body["choices"]
    assert [r["raw"] for r in up.requests[-4:]] == [CHAT, chunked, large, CHAT]
