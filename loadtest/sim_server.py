"""``kvrouter sim-replica``: an aiohttp server that answers like one SGLang replica.

This module wires the parts into an app and serves it:

* ``sim_replica``    the replica: its model, clock, driver task and request API
* ``sim_prompt``     the chat template and the token ids a request prefills
* ``sim_requests``   request bodies parsed and validated as SGLang does
* ``sim_responses``  OpenAI and native response bodies, errors, server-sent events
* ``sim_inference``  ``/generate``, ``/v1/chat/completions``, ``/v1/completions``
* ``sim_admin``      health, info, ``/v1/loads``, ``/get_load``, flush, abort, ``/metrics``
* ``sim_metrics``    the series ``/metrics`` exposes; ``sim_metrics_page`` writes its text
* ``sim_disagg``     prefill/decode disaggregation: bootstrap fields, rooms, KV transfer
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from aiohttp import web

from .profiles import Profile
from .sim_admin import AdminHandlers
from .sim_disagg import Disaggregation, bootstrap_app
from .sim_inference import InferenceHandlers
from .sim_replica import SimReplica

log = logging.getLogger("kvrouter.sim")

SIM_KEY: web.AppKey[SimReplica] = web.AppKey("sim_replica", SimReplica)


def build_app(
    profile: Profile | str = "tiny",
    time_scale: float = 1.0,
    seed: int = 0,
    *,
    replica: SimReplica | None = None,
    **kwargs: Any,
) -> web.Application:
    """The aiohttp app of one simulated replica; ``app[SIM_KEY]`` is its :class:`SimReplica`.

    Serve it with ``web.AppRunner(app, handler_cancellation=True)`` so that a client that goes
    away aborts its request in the model, as SGLang does.
    """
    sim = replica or SimReplica(profile, time_scale=time_scale, seed=seed, **kwargs)
    h = InferenceHandlers(sim)
    a = AdminHandlers(sim)
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[SIM_KEY] = sim
    r = app.router
    r.add_post("/generate", h.generate)
    r.add_post("/v1/chat/completions", h.chat_completions)
    r.add_post("/v1/completions", h.completions)
    for path in ("/health", "/health_generate"):
        r.add_get(path, a.health)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, a.model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, a.server_info)
    r.add_get("/v1/models", a.models)
    r.add_get("/v1/models/{model:.+}", a.model_card)
    r.add_get("/v1/loads", a.loads)
    r.add_get("/get_load", a.get_load)
    r.add_route("GET", "/flush_cache", a.flush_cache)
    r.add_route("POST", "/flush_cache", a.flush_cache)
    r.add_post("/abort_request", a.abort_request)
    if sim.enable_metrics:
        r.add_get("/metrics", a.metrics)

    bootstrap: list[web.AppRunner] = []

    async def _startup(app: web.Application) -> None:
        await sim.start()
        if sim.rooms is not None:  # PD prefill side: serve the bootstrap port as SGLang does
            runner = web.AppRunner(bootstrap_app(sim.rooms), access_log=None, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, sim.host, sim.disagg.bootstrap_port).start()
            bootstrap.append(runner)

    async def _cleanup(app: web.Application) -> None:
        await sim.stop()
        await h.close()
        for runner in bootstrap:
            await runner.cleanup()

    app.on_startup.append(_startup)
    app.on_cleanup.append(_cleanup)
    return app


async def serve(sim: SimReplica, host: str, port: int) -> None:
    app = build_app(replica=sim)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    sim.port = bound
    p = sim.profile
    log.info(
        "sim-replica %s on http://%s:%d profile=%s time_scale=%g kv=%d tokens page=%d%s%s",
        sim.served_model_name, host, bound, p.name, sim.time_scale, p.max_total_num_tokens,
        p.page_size, f" kv-events={sim.publisher.endpoint}" if sim.publisher else "",
        f" disaggregation={sim.disagg.mode} bootstrap-port={sim.disagg.bootstrap_port}"
        if sim.disagg.enabled else "",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def run(args: Any) -> int:
    """Entry point of ``kvrouter sim-replica`` (args from the CLI parser)."""
    from ..router.serve import install_uvloop

    install_uvloop()

    async def main() -> None:
        sim = SimReplica(
            args.profile,
            time_scale=args.time_scale,
            seed=args.seed,
            served_model_name=args.served_model_name,
            enable_cache_report=args.enable_cache_report,
            enable_metrics=args.enable_metrics,
            max_running_requests=args.max_running_requests,
            page_size=args.page_size,
            context_length=args.context_length,
            chars_per_token=args.chars_per_token,
            kv_events_config=args.kv_events_config,
            host=args.host,
            port=args.port,
            disaggregation=Disaggregation(
                args.disaggregation_mode,
                args.disaggregation_bootstrap_port,
                args.disaggregation_bootstrap_timeout,
                args.disaggregation_transfer_gbps,
            ),
            dp_size=args.dp_size,
        )
        await serve(sim, args.host, args.port)

    asyncio.run(main())
    return 0
