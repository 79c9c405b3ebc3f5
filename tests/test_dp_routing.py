"""Routing to DP-attention ranks: the router picks (replica, rank) by per-rank prefix and load,
tells SGLang with routed_dp_rank, and in PD mode picks a bootstrap room on the prefill rank.
Real servers on 127.0.0.1 (simulated replicas with --dp-size, scriptable fakes)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest

from kvrouter.loadtest import tokenizer
from kvrouter.loadtest.process_group import free_port
from kvrouter.loadtest.sim_disagg import Disaggregation
from kvrouter.loadtest.sim_server import SIM_KEY, build_app
from kvrouter.policies.rank_pick import RankView, pick_rank
from kvrouter.router.config import ConfigError, parse_config
from kvrouter.router.ranks import room_for_rank

from .fakes import FakeUpstream

FAST = 200.0
LOADS = {"source": "loads", "interval_s": 0.05}


def _chat(text: str) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


def test_rank_pick_prefers_the_cached_rank_unless_it_is_much_busier():
    cached = RankView(0, load=1, cached_tokens=500)
    idle = RankView(1, load=0)
    assert pick_rank((cached, idle)) == 0
    assert pick_rank((RankView(0, load=5, cached_tokens=500), idle)) == 1
    assert pick_rank((RankView(0, load=1, token_usage=0.5), RankView(1, load=1, token_usage=0.1))) == 1


def test_room_for_rank_keeps_the_room_random_and_63_bit():
    for room in (0, 7, 2**63 - 1):
        for rank in range(4):
            r = room_for_rank(room, rank, 4)
            assert r % 4 == rank and 0 <= r < 2**63


def test_ranks_need_per_rank_loads():
    with pytest.raises(ConfigError, match="signals.source: loads"):
        parse_config({"replicas": ["http://a:1"], "routing": {"dp_size": 2}})


async def test_rank_follows_the_prefix_and_the_replica_is_told(start_app, start_router):
    app = build_app("tiny", time_scale=FAST, dp_size=2)
    sim, url = app[SIM_KEY], await start_app(app)
    router, r_url = await start_router([url], routing={"dp_size": 2}, signals=LOADS)
    text = tokenizer.synthetic_text(400, 21)
    async with aiohttp.ClientSession() as s:
        assert router.ranks is not None
        while not router.ranks.polled(url):  # the first per-rank poll
            await asyncio.sleep(0.01)
        hits = []
        for _ in range(3):
            async with s.post(r_url + "/v1/chat/completions", json=_chat(text)) as r:
                assert r.status == 200
                hits.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
    # every turn ran on one rank, whose radix cache served the repeats
    served = [m.num_requests_total for m in sim.models]
    assert sorted(served) == [0, 3]
    assert hits[0] == 0 and hits[1] > 300 and hits[2] > 300


async def test_an_uncached_request_goes_to_the_less_loaded_rank(start_app, start_router):
    hold = asyncio.Event()
    fake = FakeUpstream("dp", hold_before_headers=hold)
    url = await start_app(fake.app())
    _, r_url = await start_router([url], routing={"dp_size": 2}, signals=LOADS)
    async with aiohttp.ClientSession() as s:
        first = asyncio.ensure_future(s.post(r_url + "/v1/chat/completions", json=_chat("one")))
        while len(fake.requests) < 1:
            await asyncio.sleep(0.005)
        second = asyncio.ensure_future(s.post(r_url + "/v1/chat/completions", json=_chat("two")))
        while len(fake.requests) < 2:
            await asyncio.sleep(0.005)
        hold.set()
        for task in (first, second):
            resp = await task
            assert resp.status == 200
            resp.release()
    ranks = [req["body"]["routed_dp_rank"] for req in fake.requests]
    assert sorted(ranks) == [0, 1]


async def test_pd_room_names_the_prefill_rank_the_router_chose(start_app, start_router):
    port = free_port()
    p_app = build_app("tiny", time_scale=FAST, dp_size=2, disaggregation=Disaggregation("prefill", port))
    p_url = await start_app(p_app)
    d_app = build_app("tiny", time_scale=FAST, disaggregation=Disaggregation("decode", bootstrap_timeout_s=5))
    d_url = await start_app(d_app)
    _, r_url = await start_router(
        [], disaggregation={"prefill": [f"{p_url}={port}"], "decode": [d_url]},
        routing={"dp_size": 2}, signals=LOADS,
    )
    async with aiohttp.ClientSession() as s:
        for i in range(4):
            async with s.post(r_url + "/v1/chat/completions", json=_chat(f"pair {i}")) as r:
                assert r.status == 200, await r.text()
        text = await (await s.get(r_url + "/metrics")).text()
    # a room on another rank than the prefill half's would fail on the decode side
    assert "kvrouter_pd_bootstrap_failures_total{" not in text
    assert sum(m.num_requests_total for m in p_app[SIM_KEY].models) == 4
    assert d_app[SIM_KEY].model.num_requests_total == 4


async def test_per_rank_loads_are_forgotten_when_the_poll_fails(closed_port_url):
    from kvrouter.metrics.router_metrics import RouterMetrics
    from kvrouter.router.config import SignalsConfig
    from kvrouter.router.poller import SignalPoller
    from kvrouter.router.ranks import RankTable
    from kvrouter.router.replicas import ReplicaRegistry
    from kvrouter.sglang_protocol.signals import ReplicaSignals

    ranks = RankTable(2, 16)
    ranks.update(closed_port_url, {0: ReplicaSignals(num_running_reqs=9, num_queue_reqs=0),
                                   1: ReplicaSignals(num_running_reqs=0, num_queue_reqs=0)})
    assert [v.load for v in ranks.views(closed_port_url, ())] == [9, 0]
    poller = SignalPoller(ReplicaRegistry([closed_port_url]), RouterMetrics(),
                          SignalsConfig(source="loads"), on_rank_loads=ranks.update)
    async with contextlib.aclosing(poller):
        await poller.poll(closed_port_url)
    assert [v.load for v in ranks.views(closed_port_url, ())] == [0, 0]
