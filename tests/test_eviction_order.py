"""The engine's eviction order, learnt from reported cache hits: a radix cache (SGLang, the
simulated replica) trims a conversation from its end, a plain LRU of pages touched root first
(the minimal replica of benchmarks/) evicts it from its root. The shadow index models the first
until a replica's reports show the second; then it drops a conversation whole."""

from __future__ import annotations

import random

import aiohttp

from kvrouter.loadtest.profiles import Profile, load_profile
from kvrouter.loadtest.sim_server import build_app
from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.policies.domain import RequestSummary
from kvrouter.policies.registry import build_policy
from kvrouter.router.engine import RoutingEngine
from kvrouter.router.learning import LEAF_FIRST_SETTLED, ROOT_FIRST_MIN_VOTES, UsageLearner
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.router.sessions import SessionTable
from kvrouter.router.usage import UsageReport

from .benchmark_modules import load_benchmark

SHARED = tuple(range(1000, 1004))  # a system prompt every conversation starts with: 4 blocks


def _conversation(n: int, blocks: int) -> tuple[int, ...]:
    return SHARED + tuple(range(n * 100, n * 100 + blocks))


def test_the_index_trims_a_conversation_from_its_end_until_told_otherwise() -> None:
    index = ShadowKVIndex(block_tokens=10, default_capacity_tokens=250)  # 25 blocks
    a, b, c = _conversation(1, 10), _conversation(2, 10), _conversation(3, 10)
    index.record("r", a)
    assert index.match_split("r", a) == (14, 0, False)
    index.record("r", b)  # takes the shared blocks: 24 held
    assert index.match_split("r", a) == (14, 4, False)  # 4 of the 14 matched blocks are b's now
    assert index.match_split("r", _conversation(5, 3)) == (4, 0, False)  # only the shared prompt
    assert index.match_split("r", (7,)) is None
    index.record("r", c)  # 10 more: a's deepest 9 go
    assert index.match(a)["r"] == 50  # the shared 4 and a's first block
    assert index.match_split("r", a) == (5, 4, True)  # trimmed
    index.set_root_first("r")  # a's root went first: nothing of it past the shared prompt matches
    assert index.match(a)["r"] == 40
    index.record("r", _conversation(4, 10))  # root first from now on: b goes whole
    assert index.match(b)["r"] == 40 and index.match(c)["r"] == 140
    assert index.cached_tokens("r") <= 250


def test_a_root_first_index_evicts_whole_conversations_and_keeps_the_shared_prompt() -> None:
    leaf, root = ShadowKVIndex(10, 300), ShadowKVIndex(10, 300)
    root.set_root_first("r")
    for i in range(1, 5):
        for index in (leaf, root):
            index.record("r", _conversation(i, 10))
    # 44 blocks recorded, 30 held: a radix engine keeps conversation 1's first blocks...
    assert leaf.match(_conversation(1, 10))["r"] == 40 and leaf.match(_conversation(2, 10))["r"] == 100
    # ...a root-first one nothing of it past the shared prompt (and of 2 neither)
    assert root.match(_conversation(1, 10))["r"] == 40 and root.match(_conversation(2, 10))["r"] == 40
    assert root.match(_conversation(3, 10))["r"] == 140 and root.match(_conversation(4, 10))["r"] == 140


def _trimmed_index() -> tuple[ShadowKVIndex, tuple[int, ...]]:
    index = ShadowKVIndex(block_tokens=10, default_capacity_tokens=250)
    a = _conversation(1, 10)
    for chain in (a, _conversation(2, 10), _conversation(3, 10)):
        index.record("r", chain)
    return index, a


def test_reports_of_only_the_shared_prompt_make_the_replica_root_first() -> None:
    index, a = _trimmed_index()
    learner = UsageLearner(block_chars=40, calibrate=False, index=index)
    capacity = index.capacity_tokens("r")
    for vote in range(ROOT_FIRST_MIN_VOTES):
        assert not index.root_first("r") and learner.learns_order("r")
        # predicted 120 (8 of the 10 blocks a holds alone), reported the shared prompt's 40
        learner.observe("r", "m", UsageReport(140, 40), prompt_bytes=0, predicted_cached=120,
                        prefix_blocks=a, match_split=(12, 4, True))
    assert index.root_first("r") and learner.learns_order("r")  # still asked: a flush resets it
    # the order explains these misses: they taught no smaller capacity
    assert index.capacity_tokens("r") == capacity and learner.learned_capacity("r") is None


def test_a_miss_of_a_conversation_the_index_held_whole_is_a_capacity_not_an_order() -> None:
    # An engine holding less than the index thinks, or one just flushed, loses conversations
    # the index has not begun to evict: whatever its order, they say nothing of it.
    index, a = _trimmed_index()
    learner = UsageLearner(block_chars=40, calibrate=False, index=index)
    for _ in range(2 * ROOT_FIRST_MIN_VOTES):
        learner.observe("r", "m", UsageReport(140, 40), prompt_bytes=0, predicted_cached=120,
                        prefix_blocks=a, match_split=(12, 4, False))
    assert learner.order_votes("r") == (0, 0) and not index.root_first("r")
    assert learner.learned_capacity("r") is not None  # the engine holds less than the index


def test_a_flush_or_restart_starts_the_learning_anew() -> None:
    index, a = _trimmed_index()
    metrics = RouterMetrics()
    learner = UsageLearner(block_chars=40, calibrate=False, index=index, metrics=metrics)
    for _ in range(ROOT_FIRST_MIN_VOTES):
        learner.observe("r", "m", UsageReport(140, 40), prompt_bytes=0, predicted_cached=120,
                        prefix_blocks=a, match_split=(12, 4, True))
    assert index.root_first("r") and learner.learns_order("r")  # still asked: see below
    assert metrics.registry.get_sample_value("kvrouter_kv_root_first", {"replica": "r"}) == 1
    # nothing cached, not even the system prompt other conversations used just now
    learner.observe("r", "m", UsageReport(140, 0), prompt_bytes=0, predicted_cached=120,
                    prefix_blocks=a, match_split=(12, 4, True))
    assert not index.root_first("r") and learner.order_votes("r") == (0, 0)
    assert metrics.registry.get_sample_value("kvrouter_kv_root_first", {"replica": "r"}) == 0


def test_a_removed_replica_is_learnt_anew() -> None:
    index, a = _trimmed_index()
    learner = UsageLearner(block_chars=40, calibrate=False, index=index)
    engine = RoutingEngine(build_policy("round_robin", {}), ReplicaRegistry(["r"]), index,
                           SessionTable(), random.Random(0), learner=learner)
    for _ in range(ROOT_FIRST_MIN_VOTES):
        learner.observe("r", "m", UsageReport(140, 40), prompt_bytes=0, predicted_cached=120,
                        prefix_blocks=a, match_split=(12, 4, True))
    assert index.root_first("r")
    engine.remove_replica("r")
    assert not index.root_first("r") and learner.order_votes("r") == (0, 0)


def test_a_hinted_target_takes_no_split() -> None:
    index, a = _trimmed_index()
    learner = UsageLearner(block_chars=40, calibrate=False, index=index)
    engine = RoutingEngine(build_policy("round_robin", {}), ReplicaRegistry(["r"]), index,
                           SessionTable(), random.Random(0), learner=learner)
    summary = RequestSummary(route="/v1/completions", prompt_tokens=140, prefix_blocks=a)
    for target, split in ((None, (5, 4, True)), ("r", None)):
        placement = engine.place(summary, None, target)
        placement.accepted()
        assert placement._match_split == split
        placement.done()


def test_the_votes_allow_for_a_block_size_a_few_percent_off() -> None:
    # 200 blocks matched, 40 of them a shared prompt: 2% of the match is 4 blocks of slack
    index, _ = _trimmed_index()
    learner = UsageLearner(block_chars=40, calibrate=False, index=index)
    chain = tuple(range(300))
    def vote(reported: int, split=(200, 40, True)) -> tuple[int, int]:
        learner.observe("r", "m", UsageReport(3000, reported), prompt_bytes=0, predicted_cached=2000,
                        prefix_blocks=chain[:240], match_split=split)
        return learner.order_votes("r")
    assert vote(1970) == (0, 0)  # 3 blocks short of the match: rounding, not a vote
    assert vote(388) == (1, 0)  # the shared prompt counted 3% short: still a root-first answer
    assert vote(430) == (2, 0)  # or 3 blocks over it
    assert vote(470) == (2, 0)  # between: no answer
    assert vote(480) == (2, 1)  # its start kept: leaf first
    assert vote(1900, (200, 190, True)) == (2, 1)  # 10 blocks its own: too few for either answer
    assert vote(199) == (0, 0) and not index.root_first("r")  # half the shared prompt lost: a flush


def test_settling_leaf_first_undoes_a_wrong_flip() -> None:
    index, a = _trimmed_index()
    learner = UsageLearner(block_chars=40, calibrate=False, index=index)
    for _ in range(ROOT_FIRST_MIN_VOTES):
        learner.observe("r", "m", UsageReport(140, 40), prompt_bytes=0, predicted_cached=120,
                        prefix_blocks=a, match_split=(12, 4, True))
    assert index.root_first("r")
    for _ in range(LEAF_FIRST_SETTLED):
        learner.observe("r", "m", UsageReport(140, 100), prompt_bytes=0, predicted_cached=120,
                        prefix_blocks=a, match_split=(12, 4, True))
    assert not index.root_first("r") and not learner.learns_order("r")


def test_a_hash_twice_in_a_dropped_conversation_goes_once() -> None:
    index = ShadowKVIndex(block_tokens=10, default_capacity_tokens=100)
    index.record("r", (1, 2, 1, 3, 4, 5))
    index.record("r", tuple(range(50, 57)))  # 7 more of 10: the first run trimmed
    index.set_root_first("r")
    assert index.match((1, 2, 1, 3)) == {} and index.cached_tokens("r") == 70


def test_a_radix_engines_partial_hits_keep_the_replica_leaf_first() -> None:
    index, a = _trimmed_index()
    learner = UsageLearner(block_chars=40, calibrate=False, index=index)
    for i in range(24):
        shared_only = i % 4 == 0  # now and then the engine had evicted more than the index did
        learner.observe("r", "m", UsageReport(140, 40 if shared_only else 100), prompt_bytes=0,
                        predicted_cached=120, prefix_blocks=a, match_split=(12, 4, True))
    assert not index.root_first("r")
    assert learner.order_votes("r") == (6, 18)
    assert not learner.learns_order("r")  # settled: leaf first
    # a match one block into the conversation tells nothing, nor does a report of what the
    # index matched or a block short of it, of between one and two blocks more than others hold, or of only
    # theirs where the index had matched under half of the conversation
    for cached, match in ((40, (5, 4, True)), (140, (12, 4, True)), (110, (12, 4, True)),
                          (70, (12, 4, True)), (40, (8, 4, True))):
        learner.observe("r", "m", UsageReport(140, cached), prompt_bytes=0, predicted_cached=50,
                        prefix_blocks=a, match_split=match)
    assert learner.order_votes("r") == (6, 18)


async def _replay(url: str, conversations: int, turns: int) -> None:
    """`conversations` chats sharing a system prompt, each turn appending ~1 KB, a random one
    at a time: more than the replica's KV holds, so the least recent ones are evicted."""
    rng = random.Random(7)
    system = "".join(rng.choice("abcdefgh ") for _ in range(1024))
    history = [[{"role": "system", "content": system}] for _ in range(conversations)]
    async with aiohttp.ClientSession() as s:
        for turn in range(turns):
            i = rng.randrange(conversations)
            messages = history[i]
            messages.append({"role": "user", "content": f"{i}:{turn} " + "".join(
                rng.choice("ijklmnop ") for _ in range(1024))})
            body = {"model": "m", "messages": messages, "max_tokens": 2}
            async with s.post(url + "/v1/chat/completions", json=body,
                              headers={"x-session-id": f"s{i}"}) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})


async def test_the_router_learns_the_minimal_replicas_root_first_eviction(start_app, start_router) -> None:
    mini = load_benchmark("mini_replica")
    args = mini.parse_args(["--port", "1", "--max-total-tokens", "12000", "--page-tokens", "16",
                            "--time-scale", "1000", "--chars-per-token", "4"])
    up = await start_app(mini.build_app(args))
    router, url = await start_router([up], signals={"interval_s": 0.05})
    await _replay(url, conversations=8, turns=150)
    assert router.index.root_first(up)
    root_votes, leaf_votes = router.learner.order_votes(up)
    assert root_votes >= ROOT_FIRST_MIN_VOTES
    assert router.metrics.registry.get_sample_value("kvrouter_kv_root_first", {"replica": up}) == 1


async def test_the_router_keeps_the_simulated_radix_replica_leaf_first(start_app, start_router) -> None:
    tiny = load_profile("tiny")
    small = Profile.model_validate({**tiny.model_dump(), "max_total_num_tokens": 12000})
    up = await start_app(build_app(small, time_scale=1000.0, seed=1))
    router, url = await start_router([up], signals={"interval_s": 0.05})
    await _replay(url, conversations=8, turns=150)
    assert not router.index.root_first(up)
    root_votes, leaf_votes = router.learner.order_votes(up)
    assert root_votes == 0 and leaf_votes >= 1


async def test_leaf_first_keeps_the_index_trimming_from_the_end(start_app, start_router) -> None:
    mini = load_benchmark("mini_replica")
    args = mini.parse_args(["--port", "1", "--max-total-tokens", "12000", "--page-tokens", "16",
                            "--time-scale", "1000", "--chars-per-token", "4"])
    up = await start_app(mini.build_app(args))
    router, url = await start_router([up], signals={"interval_s": 0.05},
                                     learning={"eviction_order": "leaf_first"})
    await _replay(url, conversations=8, turns=150)
    assert not router.index.root_first(up) and router.learner.order_votes(up) == (0, 0)


def test_the_order_is_asked_about_only_while_the_index_is_at_least_half_full() -> None:
    index = ShadowKVIndex(block_tokens=10, default_capacity_tokens=400)  # 40 blocks
    learner = UsageLearner(block_chars=40, calibrate=False, index=index)
    index.record("r", _conversation(1, 10))  # 14 blocks
    assert not learner.learns_order("r")  # an engine this empty evicts nothing
    index.record("r", _conversation(2, 10))  # 24
    assert learner.learns_order("r")
    assert not UsageLearner(block_chars=40, index=index, learn_order=False).learns_order("r")
