"""aiohttp internals the router relies on, with no public equivalent (aiohttp is pinned to the
tested minor version in pyproject.toml). Each test checks the private name exists and still has
the effect relied on, so an aiohttp upgrade that changes one fails here, by name, rather than
somewhere downstream.

- router/relay.py `_Response._send_headers_immediately = False` (a `web.StreamResponse` class
  attribute): the status line and headers go out in the same write as the first body bytes.
- router/http_errors.py: `web.AppRunner._make_server` (overridden), `web.Server._loop` and
  `web.Server._kwargs` (read to build the request handler), `aiohttp.web_protocol.RequestHandler`
  and its `handle_error(request, status, exc, message)` (overridden): protocol-level errors are
  answered with an OpenAI-shaped JSON body.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from kvrouter.router.http_errors import JSONErrorAppRunner, _JSONErrorRequestHandler
from kvrouter.router.relay import _Response


class _RecordingTransport:
    """Wraps a transport and records each write (writelines counts as one write)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.inner.write(data)

    def writelines(self, chunks: Any) -> None:
        data = b"".join(bytes(c) for c in chunks)
        self.writes.append(data)
        self.inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _first_write(response_class: type[web.StreamResponse], start_app) -> bytes:
    """Serve one streamed response of `response_class`; the first write that reached the socket."""
    seen: list[bytes] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        protocol = request.protocol
        recorder = _RecordingTransport(protocol.transport)
        protocol.transport = recorder  # type: ignore[assignment]
        try:
            response = response_class(status=200, headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: first\n\n")
            seen.extend(recorder.writes)
            await response.write_eof()
            return response
        finally:
            protocol.transport = recorder.inner

    url = await start_app(_app(handler))
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        received = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert b"data: first" in received
    assert seen, "the handler saw no write"
    return seen[0]


def _app(handler: Any) -> web.Application:
    app = web.Application()
    app.router.add_get("/", handler)
    return app


def test_send_headers_immediately_is_still_a_stream_response_class_attribute():
    assert web.StreamResponse._send_headers_immediately is True
    assert web.Response._send_headers_immediately is False  # aiohttp's own use of it
    assert _Response._send_headers_immediately is False


async def test_relay_response_sends_headers_with_the_first_body_bytes(start_app):
    first = await _first_write(_Response, start_app)
    assert first.startswith(b"HTTP/1.1 200") and b"data: first" in first
    # Control: a plain StreamResponse sends its headers alone on prepare. If both behave the
    # same, the attribute no longer has the effect the relay relies on (or the test is blind).
    plain = await _first_write(web.StreamResponse, start_app)
    assert plain.startswith(b"HTTP/1.1 200") and b"data: first" not in plain


def test_server_and_runner_internals_used_by_http_errors_exist():
    assert inspect.iscoroutinefunction(web.AppRunner._make_server)
    params = list(inspect.signature(RequestHandler.handle_error).parameters)
    assert params[:5] == ["self", "request", "status", "exc", "message"]
    assert issubclass(_JSONErrorRequestHandler, RequestHandler)


async def test_json_error_runner_builds_its_handler_from_the_servers_private_state():
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    runner = JSONErrorAppRunner(_app(ok), keepalive_timeout=7.5, access_log=None)
    await runner.setup()
    try:
        server = runner.server
        assert server is not None
        assert isinstance(server._loop, asyncio.AbstractEventLoop)
        assert server._kwargs.get("keepalive_timeout") == 7.5  # the runner's options reach it
        handler = server()
        assert isinstance(handler, _JSONErrorRequestHandler)
    finally:
        await runner.cleanup()


async def test_parser_errors_are_answered_as_json():
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    runner = JSONErrorAppRunner(_app(ok), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n")
            await writer.drain()
            raw = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
    finally:
        await runner.cleanup()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400")) and b"application/json" in head.lower()
    error = orjson.loads(body)["error"]
    assert error["code"] == 400 and error["message"].startswith("malformed HTTP request")
