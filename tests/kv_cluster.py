"""Two simulated `tiny` replicas publishing their KV events over ZMQ on 127.0.0.1, and a router
subscribed to them with the exact KV index (tokenizing as the simulated replicas do)."""

from __future__ import annotations

from typing import Any

import aiohttp

from kvrouter.loadtest.sim_server import SIM_KEY, build_app

PS = 16  # tiny profile page size
SIM_TOKENIZER = "kvrouter.loadtest.sim_prompt:kv_token_ids"


async def kv_cluster(start_app, start_router, **kv: Any):
    """(router, router URL, replica URLs); `kv` adds to the router's `kv_events` settings."""
    sims, urls = [], []
    for seed in (1, 2):
        cfg = {"publisher": "zmq", "topic": "kv-events", "endpoint": "tcp://127.0.0.1:*",
               "replay_endpoint": "tcp://127.0.0.1:*"}
        app = build_app("tiny", time_scale=200.0, seed=seed, kv_events_config=cfg)
        urls.append(await start_app(app))
        sims.append(app[SIM_KEY])
    endpoints = {u: {"endpoint": s.publisher.endpoint, "replay_endpoint": s.publisher.replay_endpoint}
                 for u, s in zip(urls, sims)}
    router, base = await start_router(
        urls, server={"host": "127.0.0.1", "port": 0, "replica_header": True},
        signals={"interval_s": 0.05},
        kv_events={"enabled": True, "page_size": PS, "tokenizer": SIM_TOKENIZER,
                   "endpoints": endpoints, **kv},
    )
    return router, base, urls


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
               **headers: str) -> tuple[str | None, dict]:
    """A chat completion that must succeed: (the replica that served it, the answer)."""
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return r.headers.get("x-kvrouter-replica"), await r.json()
