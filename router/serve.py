"""Run a Router on a port until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from aiohttp import web

from .app import Router
from .config import ConfigError, RouterConfig

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


def reload_from(router: Router, reader: Callable[[], RouterConfig]) -> None:
    """SIGHUP: re-read the config; an invalid one is logged and the old one kept."""
    try:
        config = reader()
    except ConfigError as err:
        log.error("reload refused, keeping the running config: %s", err)
        return
    changes = router.reload(config)
    log.info("config reloaded: %s", ", ".join(changes) or "no routing change")


async def serve(config: RouterConfig, reader: Callable[[], RouterConfig] | None = None) -> None:
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
    if reader is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_from, router, reader)
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()


def run(config: RouterConfig, reader: Callable[[], RouterConfig] | None = None) -> None:
    install_uvloop()
    asyncio.run(serve(config, reader))
