"""The exact KV index: SGLang KV events in, prefix matches out; then live on 127.0.0.1 with
simulated replicas publishing their events over ZMQ to a router that subscribes."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from kvrouter.loadtest import tokenizer
from kvrouter.loadtest.sim_kv_publisher import SimKVPublisher
from kvrouter.loadtest.sim_prompt import kv_token_ids
from kvrouter.sglang_protocol import block_hash as bh
from kvrouter.sglang_protocol import kv_events as kve
from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.router.config import ConfigError, KVEventsConfig, parse_config
from kvrouter.router.kv_index_exact import ExactKVIndex, request_blocks
from kvrouter.router.kv_events_subscriber import KVEventSubscriber
from kvrouter.router.tokenizers import input_ids

from .kv_cluster import PS, SIM_TOKENIZER, kv_cluster, post



def stored(hashes: list[int], medium: str | None = kve.MEDIUM_GPU) -> kve.BlockStored:
    return kve.BlockStored(hashes, None, [0] * PS * len(hashes), PS, None, medium)


def batch(*events: kve.KVEvent) -> kve.KVEventBatch:
    return kve.KVEventBatch(ts=0.0, events=list(events))


async def until(cond: Callable[[], bool]) -> None:
    while not cond():  # bounded by the pytest timeout; no wall-clock assertion
        await asyncio.sleep(0.01)


# ----------------------------------------------------------------------------------------------
# unit
# ----------------------------------------------------------------------------------------------


def test_stored_removed_cleared_drive_match():
    idx = ExactKVIndex(PS)
    chain = bh.token_block_hashes(list(range(PS * 6)), PS)
    idx.apply("a", batch(stored(chain[:4]), stored(chain[4:6])))  # one parent-linked run, split
    idx.apply("b", batch(stored(chain[:2])))
    assert idx.match(chain) == {"a": 6 * PS, "b": 2 * PS}
    assert idx.match(chain, limit=1) == {"a": 6 * PS}
    assert idx.cached_tokens("a") == 6 * PS

    idx.apply("a", batch(kve.BlockRemoved(chain[3:6], kve.MEDIUM_GPU)))  # leaf-first eviction
    assert idx.match(chain) == {"a": 3 * PS, "b": 2 * PS}
    idx.apply("a", batch(kve.BlockRemoved([12345], kve.MEDIUM_GPU)))  # never stored: ignored
    idx.apply("b", batch(kve.AllBlocksCleared()))
    assert idx.match(chain) == {"a": 3 * PS}
    assert idx.cached_tokens("b") == 0
    idx.forget("a")
    assert idx.match(chain) == {}
    # Dispatch and capacity are no evidence for the exact index.
    idx.record("a", chain)
    idx.set_capacity("a", 1)
    assert idx.match(chain) == {}


def test_host_tier_is_reported_past_the_device_prefix():
    idx = ExactKVIndex(PS)
    chain = bh.token_block_hashes(list(range(PS * 5)), PS)
    idx.apply("a", batch(stored(chain[:5])))
    # HiCache moves the tail to host: BlockRemoved(GPU) + BlockStored(CPU_PINNED).
    idx.apply("a", batch(kve.BlockRemoved(chain[2:5], kve.MEDIUM_GPU), stored(chain[2:5], kve.MEDIUM_CPU)))
    idx.apply("b", batch(stored(chain[:1], None)))  # pre-`medium` SGLang: device
    idx.apply("b", batch(stored(chain[:5], kve.MEDIUM_DISK)))  # lower tiers are ignored
    assert idx.match(chain) == {"a": 2 * PS, "b": PS}
    assert idx.match_host(chain) == {"a": 3 * PS}
    assert idx.host_cached_tokens("a") == 3 * PS
    idx.apply("a", batch(kve.BlockRemoved(chain[4:5], kve.MEDIUM_CPU)))
    assert idx.match_host(chain) == {"a": 2 * PS}
    idx.apply("a", batch(stored(chain[2:4])))  # loaded back: on both tiers
    assert idx.match(chain) == {"a": 4 * PS, "b": PS} and idx.match_host(chain) == {}


def test_request_blocks_are_the_published_hashes():
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 300}]}
    ids = kv_token_ids("/v1/chat/completions", body)
    assert ids is not None
    tokens, blocks = request_blocks(kv_token_ids, "/v1/chat/completions", body, PS)
    assert tokens == len(ids) and list(blocks) == bh.token_block_hashes(ids, PS, include_partial=False)
    # A namespace seeds the chain exactly as the simulated publisher does.
    salted = {**body, "cache_salt": "s"}
    prior = bh.namespace_prior(bh.request_namespace("tiny", salted))
    _, salted_blocks = request_blocks(kv_token_ids, "/v1/chat/completions", salted, PS)
    assert list(salted_blocks) == bh.token_block_hashes(ids, PS, prior, include_partial=False)
    # The default tokenizer only knows client-sent input_ids; bad ids or a failing plug-in
    # mean no prefix information.
    assert request_blocks(input_ids, "/v1/chat/completions", body, PS) is None
    assert request_blocks(input_ids, "/generate", {"input_ids": list(range(40))}, PS)[0] == 40
    assert request_blocks(lambda r, b: [-1] * 40, "/generate", {}, PS) is None
    assert request_blocks(lambda r, b: 1 / 0, "/generate", {}, PS) is None


def test_config_names_a_bad_tokenizer():
    with pytest.raises(ConfigError, match="kv_events.tokenizer"):
        parse_config({"kv_events": {"enabled": True, "tokenizer": "nope"}})
    with pytest.raises(ConfigError, match="cannot import"):
        parse_config({"kv_events": {"enabled": True, "tokenizer": "kvrouter.router.tokenizers:nope"}})
    cfg = parse_config({"kv_events": {"enabled": True, "tokenizer": SIM_TOKENIZER,
                                      "endpoints": {"http://h:1/": {"endpoint": "tcp://h:9"}}}})
    assert "http://h:1" in cfg.kv_events.endpoints


# ----------------------------------------------------------------------------------------------
# subscriber: sequence gaps
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replay", [False, True])
async def test_gap_is_replayed_or_drops_the_replica(replay):
    pub = SimKVPublisher(PS, endpoint="tcp://127.0.0.1:*", topic="kv-events",
                         replay_endpoint="tcp://127.0.0.1:*" if replay else None)
    pub.start()
    replica = "http://127.0.0.1:1"
    idx, metrics = ExactKVIndex(PS), RouterMetrics()
    config = KVEventsConfig(endpoints={replica: {"endpoint": pub.endpoint,
                                                 "replay_endpoint": pub.replay_endpoint}})
    sub = KVEventSubscriber(idx, config, metrics)
    blocks = itertools.count(1)

    def publish(block: int) -> None:
        pub.pending.append(stored([block]))
        pub.flush()

    try:
        sub.start([replica])
        # Publish until one arrives (a SUB misses what is sent before it has joined).
        while idx.cached_tokens(replica) == 0:
            publish(next(blocks))
            await asyncio.sleep(0.01)
        lost = next(blocks)
        send = pub._pub.send_multipart
        pub._pub.send_multipart = lambda *a, **k: None  # the PUB drops one batch
        publish(lost)
        pub._pub.send_multipart = send
        last = next(blocks)
        publish(last)
        await until(lambda: idx.match([last]) != {})
        assert metrics.kv_events_gaps.labels(replica)._value.get() == 1
        if replay:  # the lost batch came back from the replay socket
            assert idx.match([lost]) == {replica: PS}
        else:  # anything could have been lost (a removal, too): only what came after is kept
            assert idx.match([lost]) == {}
            assert idx.cached_tokens(replica) == PS
        assert metrics.kv_events.labels(replica)._value.get() >= 2
    finally:
        await sub.close()
        await pub.close()


# ----------------------------------------------------------------------------------------------
# integration: router + 2 simulated replicas over ZMQ
# ----------------------------------------------------------------------------------------------


async def test_router_routes_on_the_replicas_kv_events(start_app, start_router):
    router, base, urls = await kv_cluster(start_app, start_router)
    decisions = router.metrics.decisions

    def read(metric, *labels: str) -> float:  # the request path's counts are applied on collection
        router.metrics.flush()
        return (metric.labels(*labels) if labels else metric)._value.get()

    def blocks(body: dict) -> tuple[int, ...]:
        return request_blocks(kv_token_ids, "/v1/chat/completions", body, PS)[1]

    async with aiohttp.ClientSession() as s:
        # Until each subscription is live: probes straight to the replica, bypassing the router.
        for i, url in enumerate(urls):
            while router.metrics.kv_events.labels(url)._value.get() == 0:
                probe = {"model": "tiny", "max_tokens": 1,
                         "messages": [{"role": "user", "content": f"probe {i} " + "p" * 120}]}
                await post(s, url, probe)
                await asyncio.sleep(0.02)

        # Turn 1 of a session through the router: its replica's exact index learns the prefix.
        messages = [{"role": "system", "content": "You are a coding agent. " + tokenizer.synthetic_text(150, 1)},
                    {"role": "user", "content": "Fix:\n" + tokenizer.synthetic_text(250, 2)}]
        body1 = {"model": "tiny", "messages": messages, "max_tokens": 30}
        served, out = await post(s, base, body1, **{"x-session-id": "s1"})
        other = next(u for u in urls if u != served)
        prompt1 = out["usage"]["prompt_tokens"]
        body2 = {"model": "tiny", "max_tokens": 10, "messages": messages + [
            {"role": "assistant", "content": out["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Now add a test."}]}
        await until(lambda: router.index.match(blocks(body2)).get(served, 0) >= prompt1 - PS)
        assert other not in router.index.match(blocks(body2))

        # Turn 2 goes home, and the router expects (and finds) the cached prefix there.
        est_before = read(router.metrics.est_cached_tokens)
        affinity_before = read(decisions, "coding_agent", "affinity")
        served2, out2 = await post(s, base, body2, **{"x-session-id": "s1"})
        assert served2 == served
        assert read(decisions, "coding_agent", "affinity") == affinity_before + 1
        assert read(router.metrics.est_cached_tokens) - est_before >= prompt1 - PS
        assert out2["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt1 - PS

        # A conversation warmed directly on the other replica (another router, say): a keyless
        # continuation through this router is placed where its prefix lives.
        warm = [{"role": "user", "content": "Review:\n" + tokenizer.synthetic_text(400, 3)}]
        _, w = await post(s, other, {"model": "tiny", "messages": warm, "max_tokens": 20})
        follow = {"model": "tiny", "max_tokens": 5, "messages": warm + [
            {"role": "assistant", "content": w["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Thanks."}]}
        await until(lambda: router.index.match(blocks(follow)).get(other, 0) >= w["usage"]["prompt_tokens"] - PS)
        affinity_before = read(decisions, "coding_agent", "affinity")
        served3, _ = await post(s, base, follow)
        assert served3 == other
        assert read(decisions, "coding_agent", "affinity") == affinity_before + 1

    # Removing a replica stops its subscriber and forgets its blocks.
    assert router.membership.remove(other)
    assert router.index.cached_tokens(other) == 0


async def test_sequence_restart_forgets_and_replay_duplicates_are_skipped():
    from kvrouter.router.kv_events_subscriber import _Stream

    idx, metrics = ExactKVIndex(PS), RouterMetrics()
    sub = KVEventSubscriber(idx, KVEventsConfig(), metrics)
    stream = _Stream()
    for seq, block in ((0, 1), (1, 2)):
        await sub._on_batch("r", None, stream, seq, batch(stored([block])))
    assert idx.cached_tokens("r") == 2 * PS
    # As if seqs 2..3 had come from a replay: their live copies are duplicates.
    stream.replayed_from, stream.next_seq = 2, 4
    await sub._on_batch("r", None, stream, 3, batch(stored([99])))
    assert idx.match([99]) == {}
    # Back to 0: the replica restarted with an empty cache.
    await sub._on_batch("r", None, stream, 0, batch(stored([7])))
    assert idx.cached_tokens("r") == PS and idx.match([7]) == {"r": PS}
    assert metrics.kv_events_gaps.labels("r")._value.get() == 0
