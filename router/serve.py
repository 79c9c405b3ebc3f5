"""Run a Router on a port until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from aiohttp import web

from .app import Router
from .config import ConfigError, RouterConfig
from .security import install_log_redaction, quiet_client_protocol_errors

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
    # shutdown_timeout: on cleanup, in-flight handlers get this long to finish (the grace period).
    # keepalive_timeout: aiohttp closes a connection that has not delivered a whole request
    # (headers) within it, from the moment it opens: slowloris clients are bounded by it.
    server = router.config.server
    runner = web.AppRunner(
        router.build_app(), handler_cancellation=True, access_log=None,
        shutdown_timeout=server.shutdown_grace_s, keepalive_timeout=server.client_header_timeout_s,
    )
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
    if config is None:
        log.warning("reload ignored: the router was started without a config file")
        return
    changes = router.reload(config)
    log.info("config reloaded: %s", ", ".join(changes) or "no routing change")


async def graceful_stop(router: Router, runner: web.AppRunner) -> None:
    """SIGTERM: /ready answers 503 at once and new requests get 503 (Connection: close); after
    `shutdown_delay_s` the listener closes, idle connections are closed, and in-flight requests
    get `shutdown_grace_s` to finish before they are cut. Then the background loops stop."""
    server = router.config.server
    router.shutting_down = True
    in_flight = sum(v.in_flight for v in router.registry.snapshot().replicas)
    log.info("shutting down: not ready; %d requests in flight, grace %.1fs",
             in_flight, server.shutdown_grace_s)
    if server.shutdown_delay_s:
        await asyncio.sleep(server.shutdown_delay_s)
    left = 0

    async def at_deadline() -> None:  # what is still running when the grace period ends is cut
        nonlocal left
        await asyncio.sleep(max(0.0, server.shutdown_grace_s - 0.01))
        left = sum(v.in_flight for v in router.registry.snapshot().replicas)

    watch = asyncio.create_task(at_deadline())
    await runner.cleanup()
    watch.cancel()
    if left:
        log.warning("grace period over: %d requests cut", left)
    log.info("shut down cleanly")


async def serve(config: RouterConfig, reader: Callable[[], RouterConfig] | None = None) -> None:
    from .admin import admin_token, start_admin_site

    install_log_redaction()
    quiet_client_protocol_errors()
    router = Router(config)
    runner, port = await start_site(router, config.server.host, config.server.port)
    log.info(
        "kvrouter listening on http://%s:%d policy=%s replicas=%d",
        config.server.host, port, router.policy.name, len(router.registry),
    )
    admin_runner = None
    token = admin_token(config.admin)
    if token is not None:
        admin_runner, admin_port = await start_admin_site(
            router, token, config.admin.host, config.admin.port, reader
        )
        log.info("admin API on http://%s:%d", config.admin.host, admin_port)
    else:
        log.info("admin API disabled (set %s to enable it)", config.admin.token_env)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if reader is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_from, router, reader)
    await stop.wait()
    if admin_runner is not None:
        await admin_runner.cleanup()
    await graceful_stop(router, runner)


def run(config: RouterConfig, reader: Callable[[], RouterConfig] | None = None) -> None:
    install_uvloop()
    asyncio.run(serve(config, reader))
