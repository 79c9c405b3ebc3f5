"""aiohttp internals the router relies on, with no public equivalent (aiohttp is pinned to the
tested minor version in pyproject.toml). Each test checks the private name exists and still has
the effect relied on, so an aiohttp upgrade that changes one fails here, by name, rather than
somewhere downstream.

- router/http_errors.py (the admin port's server): `web.AppRunner._make_server` (overridden), `web.Server._loop` and
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


def _app(handler: Any) -> web.Application:
    app = web.Application()
    app.router.add_get("/", handler)
    return app


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
