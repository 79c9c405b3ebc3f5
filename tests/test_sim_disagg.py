"""Simulated replicas in SGLang's prefill/decode disaggregation: bootstrap fields, pairing by
room, the KV transfer and where the prefix cache lives. Real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import pytest

from kvrouter.cli import build_parser
from kvrouter.loadtest import tokenizer
from kvrouter.loadtest.process_group import free_port
from kvrouter.loadtest.sim_disagg import Disaggregation
from kvrouter.loadtest.sim_server import SIM_KEY, build_app

FAST = 200.0


@pytest.fixture
async def pd_pair(start_app):
    """One prefill and one decode sim replica (tiny profile); returns (prefill, decode) as
    (SimReplica, url, bootstrap_port)."""

    async def _start(**decode_kwargs: Any):
        port = free_port()
        p_app = build_app("tiny", time_scale=FAST, seed=1, disaggregation=Disaggregation("prefill", port))
        p_url = await start_app(p_app)
        d_app = build_app(
            "tiny", time_scale=FAST, seed=2,
            disaggregation=Disaggregation("decode", **decode_kwargs),
        )
        d_url = await start_app(d_app)
        return (p_app[SIM_KEY], p_url, port), (d_app[SIM_KEY], d_url)

    return _start


def _body(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "ignore_eos": True,
        **extra,
    }


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


async def _pd_request(session, p_url, d_url, port, text, room=None):
    room = random.getrandbits(63) if room is None else room
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
    (ps, pbody), (ds, dbody) = await asyncio.gather(
        _post(session, p_url, _body(text, **fields)), _post(session, d_url, _body(text, **fields))
    )
    return ps, pbody, ds, dbody


@pytest.mark.parametrize("mode", ["prefill", "decode"])
async def test_pd_server_refuses_a_request_without_bootstrap_fields(start_app, mode):
    app = build_app("tiny", time_scale=FAST, disaggregation=Disaggregation(mode, free_port()))
    url = await start_app(app)
    async with aiohttp.ClientSession() as s:
        status, body = await _post(s, url, _body("hello"))
        assert status == 400
        assert "Disaggregated request received without bootstrap room id" in body["message"]
        status, body = await _post(s, url, _body("hello", bootstrap_room=1))
        assert status == 400 and "bootstrap_host, bootstrap_port required" in body["message"]
        status, body = await _post(
            s, url, _body("hello", bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=-3)
        )
        assert status == 400
    assert app[SIM_KEY].model.num_requests_total == 0


async def test_prefill_server_refuses_another_bootstrap_port(pd_pair):
    (p, p_url, port), _ = await pd_pair()
    async with aiohttp.ClientSession() as s:
        status, body = await _post(
            s, p_url, _body("x", bootstrap_host="127.0.0.1", bootstrap_port=port + 1, bootstrap_room=5)
        )
    assert status == 400 and "bootstrap port" in body["message"]


async def test_halves_pair_by_room_and_the_prefix_cache_lives_on_the_prefill_side(pd_pair):
    (p, p_url, port), (d, d_url) = await pd_pair()
    text = tokenizer.synthetic_text(400, 3)
    async with aiohttp.ClientSession() as s:
        ps, pbody, ds, dbody = await _pd_request(s, p_url, d_url, port, text)
        assert (ps, ds) == (200, 200)
        # the prefill half generates one token; the client's answer comes from the decode half
        assert pbody["usage"]["completion_tokens"] == 1
        assert dbody["usage"]["completion_tokens"] == 8
        assert dbody["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # same prompt again: the prefill side's radix cache hits, and the decode side reports it
        ps, pbody, ds, dbody = await _pd_request(s, p_url, d_url, port, text)
        assert (ps, ds) == (200, 200)
        hit = pbody["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert hit > 300
        assert dbody["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    # the decode side computed no prefill: its prefill-side counters are the prefill server's
    assert p.model.generation_tokens_total == 2
    assert d.model.generation_tokens_total == 16


async def test_decode_half_waits_for_a_late_prefill_half(pd_pair):
    (p, p_url, port), (d, d_url) = await pd_pair()
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 77}
    async with aiohttp.ClientSession() as s:
        decode = asyncio.ensure_future(_post(s, d_url, _body("late prefill", **fields)))
        # the decode half is parked at the prefill side's bootstrap server, asking for room 77
        while 77 not in p.rooms:
            await asyncio.sleep(0.005)
        assert not decode.done()
        ps, _ = await _post(s, p_url, _body("late prefill", **fields))
        ds, dbody = await decode
    assert (ps, ds) == (200, 200)
    assert dbody["usage"]["completion_tokens"] == 8


async def test_decode_half_fails_when_no_prefill_half_comes(pd_pair):
    (p, p_url, port), (d, d_url) = await pd_pair(bootstrap_timeout_s=0.3)
    async with aiohttp.ClientSession() as s:
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 9}
        status, body = await _post(s, d_url, _body("alone", **fields))
        assert status == 500 and "timed out" in body["message"]
        # nothing listens on this bootstrap port: a bootstrap failure at once
        fields["bootstrap_port"] = free_port()
        status, body = await _post(s, d_url, _body("alone", **fields))
        assert status == 500 and "unreachable" in body["message"]
    assert d.model.num_requests_total == 0


def test_kv_transfer_time_follows_prompt_bytes_and_bandwidth():
    d = Disaggregation("decode", transfer_gbps=50.0)
    # 100k tokens of BF16 MLA latent (70,272 B/token) over 50 GB/s
    assert d.transfer_seconds(100_000, 70272) == pytest.approx(0.140544)


def test_cli_takes_sglang_disaggregation_flags():
    args = build_parser().parse_args(
        ["sim-replica", "--port", "1", "--disaggregation-mode", "prefill",
         "--disaggregation-bootstrap-port", "9001"]
    )
    assert (args.disaggregation_mode, args.disaggregation_bootstrap_port) == ("prefill", 9001)


async def test_server_info_and_loads_report_the_role(pd_pair):
    (p, p_url, port), (d, d_url) = await pd_pair()
    async with aiohttp.ClientSession() as s:
        async with s.get(p_url + "/server_info") as r:
            info = await r.json()
        async with s.get(d_url + "/v1/loads?include=disagg") as r:
            loads = await r.json()
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == port
    assert loads["loads"][0]["disaggregation"]["mode"] == "decode"


# ----------------------------------------------------------------------------------------------
# DP-attention ranks
# ----------------------------------------------------------------------------------------------


async def test_dp_ranks_have_their_own_cache_and_load(start_app):
    app = build_app("tiny", time_scale=FAST, dp_size=2)
    sim, url = app[SIM_KEY], await start_app(app)
    text = tokenizer.synthetic_text(400, 11)
    async with aiohttp.ClientSession() as s:
        status, first = await _post(s, url, _body(text, routed_dp_rank=1))
        assert status == 200
        # same prompt on the other rank: its radix cache never saw it
        status, other = await _post(s, url, _body(text, routed_dp_rank=0))
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        status, again = await _post(s, url, _body(text, routed_dp_rank=1))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 300
        status, bad = await _post(s, url, _body(text, routed_dp_rank=2))
        assert status == 400 and "routed_dp_rank" in bad["message"]
        async with s.get(url + "/v1/loads") as r:
            loads = (await r.json())["loads"]
        async with s.get(url + "/v1/loads?dp_rank=1") as r:
            one = (await r.json())["loads"]
        async with s.get(url + "/server_info") as r:
            info = await r.json()
    assert [e["dp_rank"] for e in loads] == [0, 1]
    assert [e["dp_rank"] for e in one] == [1]
    assert info["attn_dp_size"] == 2
    assert [m.num_requests_total for m in sim.models] == [1, 2]


async def test_pd_with_dp_ranks_needs_a_room_that_names_the_prefill_rank(start_app):
    port = free_port()
    p_app = build_app("tiny", time_scale=FAST, dp_size=2, disaggregation=Disaggregation("prefill", port))
    p_url = await start_app(p_app)
    d_app = build_app("tiny", time_scale=FAST, disaggregation=Disaggregation("decode", bootstrap_timeout_s=5))
    d_url = await start_app(d_app)
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
    async with aiohttp.ClientSession() as s:
        # rank 1 and an odd room: the decode side finds the KV on prefill rank 1
        body = _body("dp pair", bootstrap_room=2 * 12345 + 1, **fields)
        (ps, _), (ds, _) = await asyncio.gather(
            _post(s, p_url, {**body, "routed_dp_rank": 1}), _post(s, d_url, body))
        assert (ps, ds) == (200, 200)
        # rank 1 with an even room: the decode side looks on rank 0 and never gets its KV
        body = _body("dp pair", bootstrap_room=2 * 12345, **fields)
        (ps, _), (ds, dbody) = await asyncio.gather(
            _post(s, p_url, {**body, "routed_dp_rank": 1}), _post(s, d_url, body))
        assert ps == 200 and ds == 500 and "prefill DP rank 0" in dbody["message"]
    assert [m.num_requests_total for m in p_app[SIM_KEY].models] == [0, 2]


def test_a_rank_runs_attention_on_its_own_gpu_and_shares_the_gemms():
    from kvrouter.loadtest import timing
    from kvrouter.loadtest.profiles import load_profile
    from kvrouter.loadtest.profiles import rank_profile

    p = load_profile("kimi-k2.6-b200-tp4-dp4-fp8kv")
    r = rank_profile(p, 4)
    assert r.flops_eff_per_gpu == p.flops_eff_per_gpu
    assert r.attn_flops_eff_per_gpu == pytest.approx(p.attn_flops_eff_per_gpu / 4)
    # a long prompt's attention dominates: one rank prefills it slower than the whole replica
    assert timing.prefill_compute_time(r, 8192, 90_000) > 2 * timing.prefill_compute_time(p, 8192, 90_000)
    assert rank_profile(p, 1) is p
