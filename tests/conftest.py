from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from kvrouter.router.app import Router
from kvrouter.router.config import parse_config
from kvrouter.router.serve import start_site

StartApp = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def start_app() -> AsyncIterator[StartApp]:
    """Serve an aiohttp app on 127.0.0.1 (free port); returns its base URL."""
    runners: list[web.AppRunner] = []

    async def _start(app: web.Application) -> str:
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield _start
    for runner in reversed(runners):
        await runner.cleanup()


@pytest.fixture
async def start_router() -> AsyncIterator[Callable[..., Awaitable[tuple[Router, str]]]]:
    """Start a Router on 127.0.0.1 in front of the given replica URLs."""
    runners: list[web.AppRunner] = []

    async def _start(replicas: list[str], **overrides: Any) -> tuple[Router, str]:
        data: dict[str, Any] = {"replicas": replicas, "server": {"host": "127.0.0.1", "port": 0}}
        for key, value in overrides.items():
            data[key] = value
        router = Router(parse_config(data))
        runner, port = await start_site(router, "127.0.0.1", 0)
        runners.append(runner)
        return router, f"http://127.0.0.1:{port}"

    yield _start
    for runner in reversed(runners):
        await runner.cleanup()


@pytest.fixture
def closed_port_url() -> str:
    """A loopback URL on which nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def redis_server(tmp_path):
    from .redis_server import RedisProcess

    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.kill()
