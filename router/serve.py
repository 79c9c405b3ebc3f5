"""Run a Router on a port until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
from collections.abc import Callable

from .app import Router
from .config import ConfigError, RouterConfig
from .data_server import DataServer
from .security import install_log_redaction, quiet_client_protocol_errors

log = logging.getLogger("kvrouter")


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:  # optional: plain asyncio still works
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


async def start_site(
    router: Router, host: str, port: int, reuse_port: bool = False
) -> tuple[DataServer, int]:
    """Start serving; returns the server and the bound port (useful with port 0).
    `reuse_port`: SO_REUSEPORT, so several worker processes share the port (the kernel spreads
    new connections over them). A client that disconnects cancels its handler at once, which
    closes the upstream connection, so SGLang aborts the request instead of decoding for nobody;
    on cleanup, in-flight requests get `server.shutdown_grace_s` to finish; a connection must
    deliver a whole request's headers within `server.client_header_timeout_s` of opening or of
    its last answer (slowloris clients are bounded by it)."""
    server = router.build_server()
    bound = await server.start(host, port, reuse_port)
    return server, bound


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
    changes = router.membership.reload(config)
    log.info("config reloaded: %s", ", ".join(changes) or "no routing change")


async def graceful_stop(router: Router, runner: DataServer) -> None:
    """SIGTERM: /ready answers 503 at once and new requests get 503 (Connection: close); after
    `shutdown_delay_s` the listener closes, idle connections are closed, and in-flight requests
    get `shutdown_grace_s` to finish before they are cut. Then the background loops stop."""
    server = router.config.server
    router.stop_accepting()
    in_flight = sum(v.in_flight for v in router.registry.snapshot().replicas)
    log.info("shutting down: not ready; %d requests in flight, grace %.1fs",
             in_flight, server.shutdown_grace_s)
    if server.shutdown_delay_s:
        await asyncio.sleep(server.shutdown_delay_s)
    left = 0

    async def at_deadline() -> None:  # what is still running when the grace period ends is cut
        nonlocal left
        await asyncio.sleep(max(0.0, server.shutdown_grace_s - 0.05))
        left = sum(v.in_flight for v in router.registry.snapshot().replicas)
        # Cut now, while the connections are still open: streams get an SSE error event, the
        # rest a 503 (closing them would end the streams without one).
        router.relay.cut_requests("router shutting down: request cut at the end of the grace period")

    watch = asyncio.create_task(at_deadline())
    await runner.cleanup()
    watch.cancel()
    if left:
        log.warning("grace period over: %d requests cut", left)
    log.info("shut down cleanly")


async def serve(
    config: RouterConfig,
    reader: Callable[[], RouterConfig] | None = None,
    worker: int | None = None,
) -> None:
    from .admin import admin_token, start_admin_site

    install_log_redaction()
    quiet_client_protocol_errors()
    router = Router(config, worker=worker)
    runner, port = await start_site(
        router, config.server.host, config.server.port, reuse_port=worker is not None
    )
    log.info(
        "kvrouter %slistening on http://%s:%d policy=%s replicas=%d",
        f"worker {worker} (pid {os.getpid()}) " if worker is not None else "",
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
    freeze_startup_heap()
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


def freeze_startup_heap() -> None:
    """Move what start-up built (modules, config, the app: hundreds of thousands of objects
    that live as long as the process) out of the cyclic collector's reach. Its collections
    stop the event loop while they run; without this, every full one rescans that heap
    (tens of ms, a stall every stream in flight feels)."""
    gc.collect()
    gc.freeze()


def check_workers(config: RouterConfig, workers: int) -> None:
    """Refuse worker counts that cannot work, with one line saying why."""
    from .admin import admin_token

    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be at least 1")
    if workers == 1:
        return
    if config.affinity.store != "redis":
        raise ConfigError(
            f"--workers {workers} needs affinity.store: redis (the in-memory store lives in one "
            "process, so workers would disagree on session homes); use --workers 1 or Redis"
        )
    if admin_token(config.admin) is not None:
        raise ConfigError(
            f"--workers {workers}: the admin API changes one process's state; unset "
            f"{config.admin.token_env} or use --workers 1"
        )


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker if the parent dies (even by SIGKILL), so no orphan keeps the port."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(config: RouterConfig, reader: Callable[[], RouterConfig] | None, index: int) -> None:
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_uvloop()
    asyncio.run(serve(config, reader, worker=index))


def run_workers(
    config: RouterConfig, workers: int, reader: Callable[[], RouterConfig] | None = None
) -> int:
    """N worker processes on one port (SO_REUSEPORT); session homes and per-session in-flight
    counts are shared through Redis, and so is what each worker learns from its traffic (shadow
    index records, homed sessions: router/peer_share.py). The parent forwards SIGTERM/SIGINT
    (graceful stop) and SIGHUP (reload) to every worker; if one worker dies, the others are
    stopped too, so a supervisor sees the failure. Returns the exit status."""
    check_workers(config, workers)
    holder = None
    if config.server.port == 0:  # pick one port for all workers; hold it until they are done
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((config.server.host, 0))
        port = holder.getsockname()[1]
        config = config.model_copy(update={"server": config.server.model_copy(update={"port": port})})
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no inherited loop or sockets
    procs = [ctx.Process(target=_worker_main, args=(config, reader, i), name=f"kvrouter-worker-{i}")
             for i in range(workers)]

    stopping = [False]

    def forward(sig: int, _frame: object = None) -> None:
        if sig != signal.SIGHUP:
            if stopping[0]:
                return  # once: a second SIGTERM would kill a worker that is already shutting down
            stopping[0] = True
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGTERM if sig == signal.SIGINT else sig)
                except ProcessLookupError:
                    pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    try:
        for p in procs:
            p.start()
        log.info("kvrouter: %d workers on port %d (SO_REUSEPORT), pids %s", workers,
                 config.server.port, " ".join(str(p.pid) for p in procs))
        multiprocessing.connection.wait([p.sentinel for p in procs])
        forward(signal.SIGTERM)  # one exited (stop requested, or it died): stop the rest
        grace = config.server.shutdown_delay_s + config.server.shutdown_grace_s + 10
        for p in procs:
            p.join(grace)
            if p.exitcode is None:
                p.kill()
                p.join()
    finally:
        if holder is not None:
            holder.close()
    codes = [p.exitcode or 0 for p in procs]
    return next((c if c > 0 else 128 - c for c in codes if c), 0)


def run(config: RouterConfig, reader: Callable[[], RouterConfig] | None = None, workers: int = 1) -> int:
    if workers > 1:
        return run_workers(config, workers, reader)
    check_workers(config, workers)
    install_uvloop()
    asyncio.run(serve(config, reader))
    return 0
