"""Run a Router on a port until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from .app import Router
from .config import RouterConfig

log = logging.getLogger("kvrouter")


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:  # optional: plain asyncio still works
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


async def start_site(router: Router, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner and the bound port (useful with port 0)."""
    # handler_cancellation: a client that disconnects cancels its handler at once, which
    # closes the upstream connection, so SGLang aborts the request instead of decoding for nobody.
    runner = web.AppRunner(router.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    return runner, runner.addresses[0][1]


async def serve(config: RouterConfig) -> None:
    router = Router(config)
    runner, port = await start_site(router, config.server.host, config.server.port)
    log.info(
        "kvrouter listening on http://%s:%d policy=%s replicas=%d",
        config.server.host, port, router.policy.name, len(router.registry),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()


def run(config: RouterConfig) -> None:
    install_uvloop()
    asyncio.run(serve(config))
