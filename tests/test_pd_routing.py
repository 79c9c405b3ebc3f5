"""The router in front of a prefill/decode-disaggregated fleet (SGLang's PD protocol): pairs,
bootstrap fields, where the answer and the cache come from, retries on another pair, readiness.
Real servers on 127.0.0.1: simulated PD replicas, scriptable fakes and the openai client."""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

import aiohttp
import openai
import pytest

from kvrouter.cli import _router_config, build_parser
from kvrouter.loadtest import tokenizer
from kvrouter.loadtest.process_group import free_port
from kvrouter.loadtest.sim_disagg import Disaggregation
from kvrouter.loadtest.sim_server import SIM_KEY, build_app
from kvrouter.policies.decode_pick import pick_decode
from kvrouter.policies.domain import ReplicaView, Snapshot
from kvrouter.router.config import ConfigError, parse_config

from .fakes import FakeUpstream
from .test_decision_log import wait_for_lines

FAST = 200.0


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_prefill_and_decode_flags_make_the_prefill_servers_the_routed_pool():
    config = _router_config(_serve_args(
        "--prefill", "http://10.0.0.1:30000=9001", "--prefill", "http://10.0.0.2:30000",
        "--decode", "http://10.0.0.3:30000",
    ))
    pd = config.disaggregation
    assert config.replicas == ("http://10.0.0.1:30000", "http://10.0.0.2:30000")
    assert [p.bootstrap_port for p in pd.prefill] == [9001, 8998]
    assert pd.decode == ("http://10.0.0.3:30000",)
    # a dumped config parses back (flags on top of a file go through a dump)
    assert parse_config(config.model_dump()) == config


@pytest.mark.parametrize("data, message", [
    ({"disaggregation": {"prefill": ["http://a:1"]}}, "give at least one of each"),
    ({"disaggregation": {"prefill": ["http://a:1"], "decode": ["http://a:1"]}}, "both prefill and decode"),
    ({"replicas": ["http://b:1"], "disaggregation": {"prefill": ["http://a:1"], "decode": ["http://c:1"]}},
     "leave replicas empty"),
    ({"disaggregation": {"prefill": ["http://a:1=port"], "decode": ["http://c:1"]}}, "URL=BOOTSTRAP_PORT"),
])
def test_bad_disaggregation_configs_are_one_clear_line(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


@pytest.fixture
async def sim_fleet(start_app):
    """Simulated PD replicas; returns (prefill [(sim, url, bootstrap port)], decode [(sim, url)])."""

    async def _start(n_prefill: int = 1, n_decode: int = 1):
        prefill, decode = [], []
        for i in range(n_prefill):
            port = free_port()
            app = build_app("tiny", time_scale=FAST, seed=i, disaggregation=Disaggregation("prefill", port))
            prefill.append((app[SIM_KEY], await start_app(app), port))
        for i in range(n_decode):
            app = build_app("tiny", time_scale=FAST, seed=100 + i, disaggregation=Disaggregation("decode"))
            decode.append((app[SIM_KEY], await start_app(app)))
        return prefill, decode

    return _start


def _pd(prefill: list[Any], decode: list[Any]) -> dict[str, Any]:
    return {"prefill": [f"{url}={port}" for _, url, port in prefill],
            "decode": [url for _, url in decode]}


async def _metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s:
        text = await (await s.get(url + "/metrics")).text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_streamed_answer_comes_from_decode_and_next_turn_hits_prefill_cache(start_router, sim_fleet):
    prefill, decode = await sim_fleet(1, 1)
    (p_sim, _, _), (d_sim, _) = prefill[0], decode[0]
    _, url = await start_router([], disaggregation=_pd(prefill, decode))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": tokenizer.synthetic_text(400, 5)}]
    for turn in range(2):
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 6  # the decode server's answer
        if turn == 1:  # the prefill server's radix cache served the repeated prompt
            assert usage.prompt_tokens_details.cached_tokens > 300
    assert p_sim.model.num_requests_total == 2 and p_sim.model.generation_tokens_total == 2
    assert d_sim.model.num_requests_total == 2 and d_sim.model.generation_tokens_total == 12


async def test_a_streamed_pd_answer_logs_its_ttft_on_the_prefill_placement(start_router, sim_fleet, tmp_path):
    prefill, decode = await sim_fleet(1, 1)
    path = tmp_path / "decisions.jsonl"
    _, url = await start_router([], disaggregation=_pd(prefill, decode),
                                observability={"decision_log": str(path)})
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": tokenizer.synthetic_text(400, 5)}]
    stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True)
    [c async for c in stream]
    [line] = await wait_for_lines(path, 1)
    assert line["replica"] == prefill[0][1] and line["status"] == 200
    assert line["ttft_s"] is not None and line["ttft_s"] > 0  # the decode server's first byte


async def test_both_halves_get_the_prefill_servers_bootstrap_fields(start_app, start_router):
    port = free_port()
    p_fake, d_fake = FakeUpstream("prefill"), FakeUpstream("decode")
    p_url, d_url = await start_app(p_fake.app()), await start_app(d_fake.app())
    _, url = await start_router([], disaggregation={"prefill": [f"{p_url}={port}"], "decode": [d_url]},
                                server={"host": "127.0.0.1", "port": 0, "replica_header": True})
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={  # a client's own fields are replaced
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "bootstrap_host": "10.9.9.9", "bootstrap_room": 2**63 + 5,
        }) as r:
            assert r.status == 200
            assert r.headers["x-kvrouter-replica"] == d_url  # the client's answer is the decode half
    (pb,), (db,) = [f["body"] for f in p_fake.requests], [f["body"] for f in d_fake.requests]
    assert pb == db
    assert pb["bootstrap_host"] == "127.0.0.1" and pb["bootstrap_port"] == port
    assert 0 <= pb["bootstrap_room"] < 2**63 and pb["messages"][0]["content"] == "hi"


def test_decode_pick_takes_the_least_loaded_then_the_emptiest_kv():
    views = (
        ReplicaView("d1", num_running_reqs=3, num_queue_reqs=0, token_usage=0.1),
        ReplicaView("d2", num_running_reqs=1, num_queue_reqs=0, token_usage=0.9),
        ReplicaView("d3", num_running_reqs=1, num_queue_reqs=0, token_usage=0.2),
        ReplicaView("d4", healthy=False),
    )
    snap = Snapshot(views)
    rng = random.Random(0)
    assert pick_decode(snap, frozenset(), rng).replica == "d3"
    assert pick_decode(snap, frozenset({"d3"}), rng).replica == "d2"
    assert pick_decode(snap, frozenset({"d1", "d2", "d3"}), rng) is None


async def _router_with_dead_decode(start_router, sim_fleet, closed_port_url):
    """A router over one simulated prefill/decode pair plus a decode server on a closed port
    (listed first), up to 3 attempts, its decode pick seeded; and the prefill servers."""
    prefill, decode = await sim_fleet(1, 1)
    pd = _pd(prefill, decode)
    pd["decode"].insert(0, closed_port_url)
    router, url = await start_router([], disaggregation=pd, upstream={"max_attempts": 3})
    assert router.decode_pool is not None
    router.decode_pool.rng = random.Random(0)
    return router, url, prefill


async def test_a_dead_decode_server_is_retried_on_another_pair(start_router, sim_fleet, closed_port_url):
    router, url, _ = await _router_with_dead_decode(start_router, sim_fleet, closed_port_url)
    async with aiohttp.ClientSession() as s:
        for _ in range(12):  # the pick ties at random between the two idle decode servers
            async with s.post(url + "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
            }) as r:
                assert r.status == 200, await r.text()
            if await _metric(url, 'kvrouter_pd_bootstrap_failures_total{stage="decode"}'):
                break
    assert await _metric(url, 'kvrouter_pd_bootstrap_failures_total{stage="decode"}') >= 1


async def test_a_prefill_server_that_refuses_is_retried_on_another_pair(start_app, start_router, sim_fleet):
    prefill, decode = await sim_fleet(1, 1)
    busy = FakeUpstream("busy", status=503)
    busy_url = await start_app(busy.app())
    pd = _pd(prefill, decode)
    pd["prefill"].insert(0, busy_url)
    # polled once only: the refusing server stays healthy (a 503 answer is no health failure)
    _, url = await start_router([], disaggregation=pd, policy={"name": "round-robin"},
                                signals={"interval_s": 60})
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(url + "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            }) as r:
                assert r.status == 200, await r.text()
    assert busy.errors >= 1  # round robin sent at least one of the three there first
    assert await _metric(url, 'kvrouter_pd_bootstrap_failures_total{stage="prefill"}') == busy.errors
    # only the pairs that were served reached the decode server's scheduler
    assert decode[0][0].model.num_requests_total == 3


async def test_a_client_error_from_the_prefill_server_is_relayed_not_retried(start_router, sim_fleet):
    prefill, decode = await sim_fleet(1, 1)
    _, url = await start_router([], disaggregation=_pd(prefill, decode))
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1,
        }) as r:
            assert r.status == 400
    assert await _metric(url, "kvrouter_upstream_retries_total") == 0


async def test_ready_only_when_both_pools_have_a_server_up(start_router, sim_fleet, closed_port_url):
    prefill, decode = await sim_fleet(1, 1)
    pd = _pd(prefill, [])
    pd["decode"] = [closed_port_url]
    router, url = await start_router([], disaggregation=pd, signals={"interval_s": 0.05})
    async with aiohttp.ClientSession() as s:
        while router.poller.up_count() == 0:  # the prefill server has answered a poll
            await asyncio.sleep(0.01)
        async with s.get(url + "/ready") as r:
            body = await r.json()
            assert r.status == 503
            assert body["prefill_servers_up"] == 1 and body["decode_servers_up"] == 0
    pd["decode"] = [decode[0][1]]
    router, url = await start_router([], disaggregation=pd, signals={"interval_s": 0.05})
    async with aiohttp.ClientSession() as s:
        while True:  # bounded by the test timeout
            async with s.get(url + "/ready") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.01)


async def test_a_reload_applies_the_decode_list_and_bootstrap_ports(start_router, sim_fleet):
    prefill, decode = await sim_fleet(1, 2)
    (_, p_url, port), (_, d1), (_, d2) = prefill[0], decode[0], decode[1]
    router, url = await start_router([], disaggregation={"prefill": [f"{p_url}=1"], "decode": [d1]})
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={  # bootstrap port 1: refused
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        }) as r:
            assert r.status == 400
        changes = router.membership.reload(parse_config(
            {"disaggregation": {"prefill": [f"{p_url}={port}"], "decode": [d2]}}))
        assert sorted(changes) == [f"+decode {d2}", f"-decode {d1}"]
        assert router.decode_pool is not None and router.decode_pool.registry.urls() == [d2]
        async with s.post(url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        }) as r:
            assert r.status == 200, await r.text()
    assert decode[1][0].model.num_requests_total == 1 and decode[0][0].model.num_requests_total == 0
