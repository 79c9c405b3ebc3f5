"""What the router learns from reported usage: bytes per token (per model and per replica) and a
replica's effective KV capacity, which corrects the shadow index after a reported miss. Live
tests run a real router in front of real aiohttp replicas on 127.0.0.1 that report chosen
prompt and cached tokens."""

from __future__ import annotations

import random
import aiohttp
import orjson
from aiohttp import web

from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.learning import MIN_OWN_REPORTS, UsageLearner
from kvrouter.router.prefix import namespace, prompt_bytes, text_block_hashes
from kvrouter.router.usage import UsageReport

CHAT = "/v1/chat/completions"


def _text(n_bytes: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnop") for _ in range(n_bytes))


def _replica(bytes_per_token: dict[str, float], cached: int = 0) -> web.Application:
    """A replica whose tokenizer takes `bytes_per_token[model]` bytes of the prompt (as the
    router renders it) per token, and that reports `cached` cached tokens."""

    async def chat(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        tokens = round(len(prompt_bytes(CHAT, body)) / bytes_per_token[body["model"]])
        usage = {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1,
                 "prompt_tokens_details": {"cached_tokens": min(cached, tokens)}}
        return web.json_response({"id": "c", "object": "chat.completion", "choices": [], "usage": usage})

    app = web.Application()
    app.router.add_post(CHAT, chat)
    return app


async def _chat(session: aiohttp.ClientSession, url: str, model: str, text: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    async with session.post(url + CHAT, json=body) as r:
        assert r.status == 200
        await r.read()


async def test_bytes_per_token_converges_per_model_within_tens_of_requests(start_app, start_router) -> None:
    ratios = {"cjk": 1.5, "code": 8.0}
    up = await start_app(_replica(ratios))
    router, url = await start_router([up])
    assert router.learner.bytes_per_token("cjk") == 4.0  # before any report
    async with aiohttp.ClientSession() as s:
        for i in range(30):
            for model in ratios:
                await _chat(s, url, model, _text(1000 + 37 * i, seed=i))
    for model, ratio in ratios.items():
        assert abs(router.learner.bytes_per_token(model) - ratio) < 0.05 * ratio, model
        gauge = router.metrics.registry.get_sample_value("kvrouter_bytes_per_token", {"model": model})
        assert gauge == router.learner.bytes_per_token(model)
    # the prompt size a policy sees is calibrated
    body = {"model": "cjk", "messages": [{"role": "user", "content": _text(3000, seed=99)}]}
    summary = await router.handlers.summarize_request(CHAT, body, {})
    expected = len(prompt_bytes(CHAT, body)) / 1.5
    assert abs(summary.prompt_tokens - expected) < 0.05 * expected


def test_block_size_and_capacity_follow_each_replica() -> None:
    index = ShadowKVIndex(block_tokens=64, default_capacity_tokens=10_000)
    learner = UsageLearner(block_chars=256, weight=0.1, index=index)
    for _ in range(40):
        learner.observe("a", "m", UsageReport(1000, None), prompt_bytes=1500, predicted_cached=0, prefix_blocks=())
        learner.observe("b", "m", UsageReport(1000, None), prompt_bytes=8000, predicted_cached=0, prefix_blocks=())
    assert abs(learner.replica_bytes_per_token("a") - 1.5) < 0.05
    assert abs(learner.replica_bytes_per_token("b") - 8.0) < 0.2
    blocks = list(range(1, 101))
    index.record("a", blocks)
    index.record("b", blocks)
    # replica a: ~171 tokens per 256-byte block, so 10k tokens hold only ~58 of the 100 blocks
    assert 56 <= index.cached_tokens("a") / index.block_tokens_of("a") <= 60
    assert index.match(blocks)["b"] == int(100 * index.block_tokens_of("b"))  # 32/block: all fit
    assert index.match(blocks)["a"] == int(58 * index.block_tokens_of("a"))


def test_a_reported_surplus_raises_the_learnt_capacity() -> None:
    index = ShadowKVIndex(block_tokens=64, default_capacity_tokens=100_000)
    learner = UsageLearner(block_chars=256, weight=0.5, calibrate=False, index=index)
    index.record("r", list(range(1, 101)))  # 6400 tokens held
    learner.observe("r", "m", UsageReport(3000, 0), prompt_bytes=0, predicted_cached=3000, prefix_blocks=(1,))
    shrunk = index.capacity_tokens("r")
    assert shrunk < 6400  # it evicted while the index held 6400 tokens for it
    learner.observe("r", "m", UsageReport(3000, 3000), prompt_bytes=0, predicted_cached=0, prefix_blocks=(1,))
    assert index.capacity_tokens("r") > shrunk
    # a replica that reports its capacity keeps it: the learnt one only stands in for it
    index.set_capacity("r", 50_000)
    assert index.capacity_tokens("r") == 50_000
    index.learnt_below_reported = True  # learning.learnt_capacity: always
    assert index.capacity_tokens("r") < 6400


async def test_reported_misses_trim_the_index_as_the_engine_evicted(start_app, start_router) -> None:
    """A replica with a KV cache too small to keep anything reports no hits: the index learns its
    effective capacity and drops the replica's oldest conversation, as the engine did, while the
    conversation it just cached again stays."""
    up = await start_app(_replica({"m": 4.0}, cached=0))
    router, url = await start_router([up], learning={"ewma_weight": 0.5, "calibrate": False})
    old = _text(4096, seed=1)
    new = _text(4096, seed=2)
    old_blocks = text_block_hashes(prompt_bytes(CHAT, {"messages": [{"role": "user", "content": old}]}),
                                   namespace({"model": "m"}), 256)
    new_blocks = text_block_hashes(prompt_bytes(CHAT, {"messages": [{"role": "user", "content": new}]}),
                                   namespace({"model": "m"}), 256)
    async with aiohttp.ClientSession() as s:
        await _chat(s, url, "m", old)
        assert router.index.match(old_blocks).get(up, 0) > 0  # recorded; never a hit reported
        for _ in range(20):
            await _chat(s, url, "m", new)  # predicted a hit every time, reported none
            if not router.index.match(old_blocks):
                break
    assert not router.index.match(old_blocks)
    assert router.index.match(new_blocks)[up] > 0
    assert router.index.capacity_tokens(up) < router.index.default_capacity_tokens
    reg = router.metrics.registry
    predicted = reg.get_sample_value("kvrouter_cached_tokens_predicted_total", {"replica": up})
    assert predicted > 0 and reg.get_sample_value("kvrouter_cached_tokens_reported_total", {"replica": up}) == 0
    assert reg.get_sample_value("kvrouter_cache_prediction_error_ratio_bucket", {"le": "-0.5"}) >= 1


async def test_a_hinted_target_has_no_prediction_to_learn_from(start_app, start_router) -> None:
    up = await start_app(_replica({"m": 2.0}, cached=500))
    router, url = await start_router([up], routing={"allow_target_hint": True})
    body = {"model": "m", "messages": [{"role": "user", "content": _text(4000, seed=7)}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + CHAT, json=body, headers={"x-smg-target-worker": up}) as r:
            assert r.status == 200
    reg = router.metrics.registry
    assert reg.get_sample_value("kvrouter_cache_prediction_error_ratio_count") == 0
    assert router.index.capacity_tokens(up) == router.index.default_capacity_tokens
    assert router.learner.bytes_per_token("m") < 4.0  # its prompt size still calibrates


def test_a_new_replica_follows_its_models_ratio_so_prompt_and_index_share_one_unit() -> None:
    """Replica "a" has reported once, "b" many times: the prompt size follows the model's ratio,
    so "a"'s block size must too, or a prompt "a" holds whole looks only ~60% cached there."""
    index = ShadowKVIndex(block_tokens=64, default_capacity_tokens=1_000_000)
    learner = UsageLearner(block_chars=256, weight=0.1, index=index)
    learner.observe("a", "m", UsageReport(1000, None), prompt_bytes=1500, predicted_cached=0, prefix_blocks=())
    for _ in range(6):
        learner.observe("b", "m", UsageReport(1000, None), prompt_bytes=1500, predicted_cached=0, prefix_blocks=())
    blocks = list(range(1, 101))
    index.record("a", blocks)
    prompt_tokens = 100 * 256 / learner.bytes_per_token("m")  # what the summary would say
    assert index.match(blocks)["a"] / prompt_tokens > 0.98
    assert learner.replica_bytes_per_token("a") == learner.bytes_per_token("m")
    # once "a" has reports enough of its own, its own estimate (started from the model's) is used
    for _ in range(20):
        learner.observe("a", "m", UsageReport(1000, None), prompt_bytes=1500, predicted_cached=0, prefix_blocks=())
    assert abs(learner.replica_bytes_per_token("a") - 1.5) < 0.1


def test_the_first_reports_replace_the_starting_ratio_instead_of_averaging_with_it() -> None:
    """The starting 4 bytes per token is a guess, not a report: averaged in as one, a model at 8
    read 6 after its first report and still 7.6 after its tenth, so the first sessions (placed
    before the ratio settles) had their prompts, homed KV and KV room counted up to 2x."""
    index = ShadowKVIndex(block_tokens=64, default_capacity_tokens=1_000_000)
    learner = UsageLearner(block_chars=256, weight=0.1, index=index)
    learner.observe("a", "m", UsageReport(1000, None), prompt_bytes=8000, predicted_cached=0, prefix_blocks=())
    assert learner.bytes_per_token("m") == 8.0
    assert index.block_tokens_of("a") == 32.0  # the index's block size in the same unit
    learner.observe("b", "m", UsageReport(1000, None), prompt_bytes=7000, predicted_cached=0, prefix_blocks=())
    assert learner.bytes_per_token("m") == 7.5  # a running mean of the reports alone
    # a replica's own estimate starts from its model's reports (a real prior), counted as one
    for _ in range(MIN_OWN_REPORTS):
        learner.observe("b", "m", UsageReport(1000, None), prompt_bytes=7000, predicted_cached=0, prefix_blocks=())
    assert 7.0 < learner.replica_bytes_per_token("b") < 7.1
