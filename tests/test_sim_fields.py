"""SGLang's field semantics, through the real simulated replica server (real aiohttp server on
127.0.0.1, the real openai client) and through the router's own parsers."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.loadtest import tokenizer
from kvrouter.loadtest.profiles import load_profile
from kvrouter.loadtest.sim_server import SIM_KEY, build_app
from kvrouter.sglang_protocol import metric_names as sg
from kvrouter.sglang_protocol.loads import parse_loads_json
from kvrouter.sglang_protocol.signals import parse_metrics_text

FAST = 200.0
TINY = load_profile("tiny")  # has speculative decoding (accept 2.5 of 4)
PLAIN = TINY.model_copy(update={"spec_accept_length": 1.0, "spec_verify_tokens": 1})


@pytest.fixture
async def start_sim(start_app):
    async def _start(profile: Any = TINY, **kwargs: Any):
        kwargs.setdefault("time_scale", FAST)
        app = build_app(profile, **kwargs)
        url = await start_app(app)
        return app[SIM_KEY], url

    return _start


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def _get(url: str, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path) as r:
            if r.content_type == "application/json":
                return r.status, await r.json()
            return r.status, await r.text()


async def _post(url: str, path: str, body: dict) -> Any:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body) as r:
            assert r.status == 200
            if body.get("stream"):
                return [line[6:] async for line in r.content if line.startswith(b"data: {")]
            return await r.json()


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


# ---- /v1/loads ------------------------------------------------------------------------------------
async def test_v1_loads_default_is_every_section_without_a_rank_timestamp(start_sim):
    sim, url = await start_sim()
    await _post(url, "/generate", {"text": tokenizer.synthetic_text(100, 1),
                                   "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
    status, body = await _get(url, "/v1/loads")
    assert status == 200
    assert set(body) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    (entry,) = body["loads"]
    assert list(entry)[:12] == [
        "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
        "num_used_tokens", "num_total_tokens", "max_total_num_tokens", "max_running_requests",
        "token_usage", "gen_throughput", "cache_hit_rate", "utilization",
    ]
    assert "timestamp" not in entry
    assert "lora" not in entry  # no LoRA: the section is left out
    assert entry["disaggregation"]["mode"] == "null"
    assert set(entry["queues"]) == {"waiting", "grammar", "paused", "retracted"}
    assert entry["memory"]["token_capacity"] == TINY.max_total_num_tokens
    # 200 tokens at 2.5 per step pass 40 decode steps: a decode report fed the spec section
    assert entry["speculative"]["accept_length"] == TINY.spec_accept_length
    assert entry["utilization"] == 0.0  # no max_running_requests_under_SLO, as in SGLang
    _, core = await _get(url, "/v1/loads?include=core")
    assert set(core["loads"][0]) == set(list(entry)[:12])
    _, queues = await _get(url, "/v1/loads?include=queues")
    assert "queues" in queues["loads"][0] and "memory" not in queues["loads"][0]
    # the router's parser takes the shape without a timestamp (the poller stamps its own)
    signals = parse_loads_json(body)
    assert signals.max_total_num_tokens == TINY.max_total_num_tokens
    assert signals.num_running_reqs == 0


async def test_server_info_reports_the_cadence_defaults(start_sim):
    sim, url = await start_sim()
    _, info = await _get(url, "/server_info")
    assert info["decode_log_interval"] == 40
    assert info["load_snapshot_publish_interval"] == 15
    assert info["weight_version"] == "default"


async def test_v1_loads_has_no_spec_section_before_a_decode_report(start_sim):
    sim, url = await start_sim()
    _, body = await _get(url, "/v1/loads")
    assert "speculative" not in body["loads"][0]
    assert body["loads"][0]["num_waiting_uncached_tokens"] == 0


async def test_waiting_uncached_tokens_count_the_queue(start_sim):
    profile = PLAIN.model_copy(update={"max_running_requests": 1})
    sim, url = await start_sim(profile, time_scale=1.0)
    long = {"text": tokenizer.synthetic_text(64, 1),
            "sampling_params": {"max_new_tokens": 100000, "ignore_eos": True}}
    first = sim.submit(prompt_text=long["text"], max_new_tokens=100000, ignore_eos=True)
    second = sim.submit(prompt_text=tokenizer.synthetic_text(200, 2), max_new_tokens=10)
    try:
        # the second request waits (one slot); the snapshot counts it once published
        while True:
            _, body = await _get(url, "/v1/loads")
            entry = body["loads"][0]
            if entry["num_waiting_reqs"] == 1:
                break
        assert entry["num_waiting_uncached_tokens"] == second.prompt_len
        assert entry["num_total_tokens"] == entry["num_used_tokens"] + second.prompt_len
    finally:
        sim.abort(first.rid)
        sim.abort(second.rid)


# ---- /metrics -------------------------------------------------------------------------------------
async def test_tokenizer_metrics_carry_is_streaming(start_sim):
    sim, url = await start_sim(PLAIN)
    client = _client(url)
    try:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=5)
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello again"}], max_tokens=5,
            stream=True)
        async for _ in stream:
            pass
    finally:
        await client.close()
    _, text = await _get(url, "/metrics")
    fams = _families(text)
    for fam_name in ("sglang:prompt_tokens", "sglang:generation_tokens", "sglang:num_requests"):
        values = {s.labels["is_streaming"]: s.value for s in fams[fam_name].samples
                  if s.name.endswith("_total")}
        assert set(values) == {"true", "false"}, fam_name
    assert {s.labels["is_streaming"]: s.value for s in fams["sglang:num_requests"].samples
            if s.name.endswith("_total")} == {"true": 1.0, "false": 1.0}
    for fam_name in ("sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds"):
        counts = {s.labels["is_streaming"]: s.value for s in fams[fam_name].samples
                  if s.name.endswith("_count")}
        assert counts == {"true": 1.0, "false": 1.0}, fam_name
    assert all("is_streaming" not in s.labels
               for s in fams["sglang:inter_token_latency_seconds"].samples)
    # no spec decoding: SGLang still sets both spec gauges, at 0; utilization stays 0
    gauges = {n: fams["sglang:" + n].samples[0].value
              for n in ("spec_accept_length", "spec_accept_rate", "utilization")}
    assert gauges == {"spec_accept_length": 0.0, "spec_accept_rate": 0.0, "utilization": 0.0}
    parse_metrics_text(text, strict=True)  # the router still parses the whole page


@pytest.mark.parametrize("hicache", [False, True])
async def test_radix_cache_counters_carry_cache_type(start_sim, hicache):
    # A KV pool of 40 pages: the second prompt evicts the first one's pages.
    update: dict[str, Any] = {"max_total_num_tokens": 640, "chunked_prefill_size": 512}
    if hicache:
        update["host_total_num_tokens"] = 4096
    sim, url = await start_sim(PLAIN.model_copy(update=update))
    prompts = [tokenizer.synthetic_text(400, seed) for seed in (1, 2, 1)]
    for text in prompts:
        await _post(url, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 4}})
    _, page = await _get(url, "/metrics")
    fams = _families(page)
    evicted = fams["sglang:evicted_tokens"].samples
    cache_type = "HiRadixCache" if hicache else "RadixCache"
    assert [s.labels for s in evicted if s.name.endswith("_total")] == [{"cache_type": cache_type}]
    assert evicted[0].value == sim.model.evicted_tokens_total > 0
    load_back = [s for s in fams["sglang:load_back_tokens"].samples if s.name.endswith("_total")]
    if hicache:  # the third prompt came back from the host pool
        assert [s.labels for s in load_back] == [{"cache_type": "HiRadixCache", "pool": "kv"}]
        assert load_back[0].value == sim.model.load_back_tokens_total > 0
    else:
        assert load_back == []
    assert parse_metrics_text(page, strict=True).num_running_reqs == 0


# ---- /generate and OpenAI usage -------------------------------------------------------------------
async def test_generate_meta_info_fields(start_sim):
    sim, url = await start_sim()
    body = {"text": "count to ten", "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
    out = await _post(url, "/generate", body)
    meta = out["meta_info"]
    assert meta["weight_version"] == "default" and meta["total_retractions"] == 0
    assert meta["completion_tokens"] == 30 and meta["e2e_latency"] > 0
    # speculative decoding: 29 tokens after the prefill's at 2.5 per verify pass
    assert meta["spec_verify_ct"] == 12
    assert meta["spec_accept_length"] == pytest.approx(30 / 12)
    assert meta["spec_accept_rate"] == pytest.approx((30 - 1 - 12) / (12 * 3))
    # At FAST the whole decode takes well under a millisecond of wall time, so a busy machine can
    # see all of it at the stream's first poll: stream in real time, for about half a second.
    _, real_time_url = await start_sim(time_scale=1.0)
    long = {**body, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}, "stream": True}
    chunks = await _post(real_time_url, "/generate", long)
    metas = [orjson.loads(c)["meta_info"] for c in chunks]
    assert len(metas) > 1
    for m in metas:
        assert m["weight_version"] == "default" and m["total_retractions"] == 0
    assert all("e2e_latency" not in m and "spec_verify_ct" not in m for m in metas[:-1])
    assert "e2e_latency" in metas[-1] and "spec_verify_ct" in metas[-1]


async def test_generate_without_spec_has_no_spec_fields(start_sim):
    sim, url = await start_sim(PLAIN)
    out = await _post(url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 5}})
    assert not any(k.startswith("spec_") for k in out["meta_info"])
    assert "e2e_latency" in out["meta_info"]


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_usage_has_reasoning_tokens_at_top_level(start_sim, stream):
    sim, url = await start_sim(PLAIN)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        chunks = await _post(url, "/v1/chat/completions", body)
        usage = orjson.loads(chunks[-1])["usage"]
    else:
        usage = (await _post(url, "/v1/chat/completions", body))["usage"]
    assert usage["reasoning_tokens"] == 0
    assert list(usage) == ["prompt_tokens", "total_tokens", "completion_tokens",
                           "prompt_tokens_details", "reasoning_tokens"]


# ---- cadence through the HTTP driver -------------------------------------------------------------
async def _running(url: str) -> tuple[float, int]:
    _, text = await _get(url, "/metrics")
    gauges = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    _, loads = await _get(url, "/v1/loads?include=core")
    return gauges["sglang:num_running_reqs"], loads["loads"][0]["num_running_reqs"]


@pytest.mark.parametrize("interval", [1, 10**9])
async def test_http_replica_serves_the_published_gauges(start_sim, interval):
    """A decoding request shows as running only once a decode report published it: at once
    with an interval of one step, never with an interval longer than the run."""
    profile = PLAIN.model_copy(update={
        "decode_log_interval": interval, "load_snapshot_publish_interval": interval})
    sim, url = await start_sim(profile, time_scale=1.0)
    st = sim.submit(prompt_text=tokenizer.synthetic_text(64, 1), max_new_tokens=100000,
                    ignore_eos=True)
    try:
        while st.first is None:  # bounded by the test timeout
            await _tick()
        assert sim.model.load(sim.now()).num_running_reqs == 1
        if interval == 1:
            while await _running(url) != (1.0, 1):
                await _tick()
        else:
            for _ in range(5):  # the prefill report counted the new request as not yet running
                assert await _running(url) == (0.0, 0)
                await _tick()
    finally:
        sim.abort(st.rid)


async def _tick() -> None:
    await asyncio.sleep(0.01)


# ---- retraction -----------------------------------------------------------------------------------
def _samples(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.parametrize("stream", [False, True])
async def test_retractions_are_published_in_metrics_and_meta_info(start_sim, stream):
    """A 4,096-token pool over-admits eight requests: decode runs out of KV and retracts. The
    counters count every retraction, the gauges are the published ones, and each request's
    meta_info total_retractions says how often it was retracted (streamed: so far)."""
    # a slower clock than FAST: the eight arrivals must land within a fraction of a model second
    sim, url = await start_sim(TINY.model_copy(update={"max_total_num_tokens": 4096}), time_scale=10.0)
    bodies = [{"text": tokenizer.synthetic_text(200, 400 + i),
               "sampling_params": {"max_new_tokens": 900 + 37 * i, "ignore_eos": True},
               "stream": stream}
              for i in range(8)]

    async def post(s: aiohttp.ClientSession, body: dict) -> Any:
        async with s.post(url + "/generate", json=body) as r:
            assert r.status == 200
            if not stream:
                return await r.json()
            chunks = [orjson.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
            counts = [c["meta_info"]["total_retractions"] for c in chunks]
            assert counts == sorted(counts) and counts[0] == 0  # the count so far, in every chunk
            streamed_counts.append(counts)
            return chunks[-1]

    streamed_counts: list[list[int]] = []
    async with aiohttp.ClientSession() as s:
        outs = await asyncio.gather(*(post(s, b) for b in bodies))
    if stream:  # chunks streamed after a re-prefill already say so, not only the last one (a
        # request retracted just before its last chunk has no other to say it in)
        retracted = [counts for counts in streamed_counts if counts[-1]]
        assert retracted and any(counts[-2] == counts[-1] for counts in retracted)
    retractions = [o["meta_info"]["total_retractions"] for o in outs]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [900 + 37 * i for i in range(8)]
    model = sim.model
    assert sum(retractions) == model.num_retracted_reqs_total > 0
    _, text = await _get(url, "/metrics")
    s = _samples(text)
    assert s["sglang:num_retracted_requests_total"] == model.num_retracted_reqs_total
    assert s["sglang:num_retracted_input_tokens_total"] == model.num_retracted_input_tokens_total > 0
    assert s["sglang:num_retracted_output_tokens_total"] == model.num_retracted_output_tokens_total > 0
    published = sim.published_metrics()
    assert s["sglang:num_retracted_reqs"] == published.num_retracted_reqs
    assert s["sglang:new_token_ratio"] == pytest.approx(published.new_token_ratio)
    assert 0 < published.new_token_ratio <= 1
    fams = _families(text)
    assert fams["sglang:num_retracted_reqs"].documentation == "The number of retracted requests."
    assert fams["sglang:num_retracted_requests"].type == "counter"
    # the router still reads the exposition
    assert parse_metrics_text(text).max_total_num_tokens == 4096


async def test_no_retraction_counters_before_a_retraction(start_sim):
    """prometheus_client shows a labelled counter from its first increment: none without a retraction."""
    sim, url = await start_sim()
    out = await _post(url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 5}})
    assert out["meta_info"]["total_retractions"] == 0
    _, text = await _get(url, "/metrics")
    s = _samples(text)
    assert "sglang:num_retracted_requests_total" not in s
    assert s["sglang:num_retracted_reqs"] == 0.0
