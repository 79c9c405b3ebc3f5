"""coding_agent's pipeline steps one by one (policies/steps.py), and the capabilities policies
declare to the engine's housekeeping. Hand-built views, seeded rng, no servers."""

from __future__ import annotations

import random

import pytest

from kvrouter.policies.domain import Capabilities, ReplicaView, RequestSummary, Snapshot
from kvrouter.policies.cost import DEFAULT_CAPACITY_TOKENS, CostParams, expected_costs
from kvrouter.policies.registry import TYPES, build_policy
from kvrouter.policies.steps import (
    CandidateSampler,
    ExpectedCost,
    HighWater,
    NearTiePowerOfTwo,
    fresh_below_mean,
    without,
)
from kvrouter.router.engine import RoutingEngine
from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.router.sessions import SessionTable

MARKS = HighWater(max_running=40, max_queue=2, max_token_usage=0.92)


def req(prompt: int = 10_000, cached: dict[str, int] | None = None, **kw) -> RequestSummary:
    return RequestSummary("/v1/chat/completions", session_key="s", prompt_tokens=prompt,
                          cached_tokens=cached or {}, **kw)


# -- filters -------------------------------------------------------------------------------------
@pytest.mark.parametrize("view, over", [
    (ReplicaView("a", num_running_reqs=39, num_queue_reqs=0), False),
    (ReplicaView("a", num_running_reqs=38, num_queue_reqs=2), True),   # load 40 reaches the mark
    (ReplicaView("a", in_flight=40), True),                           # own in-flight counts too
    (ReplicaView("a", num_running_reqs=1, num_queue_reqs=3), True),    # queue over 2
    (ReplicaView("a", token_usage=0.92), False),                      # at the mark is fine
    (ReplicaView("a", token_usage=0.93), True),
    (ReplicaView("a", num_queue_reqs=3, token_usage=0.93), True),  # over both kinds of mark
    (ReplicaView("a"), False),                                        # unknown signals: not over
])
def test_high_water_marks(view, over):
    assert MARKS.overloaded(view) is over
    assert MARKS([view]) == ([] if over else [view])
    # The marks other than token_usage.
    assert MARKS.over_request_marks(view) is (view.load >= 40 or (view.num_queue_reqs or 0) > 2)


def test_high_water_filter_keeps_order():
    views = [ReplicaView("a"), ReplicaView("b", num_queue_reqs=5), ReplicaView("c")]
    assert [r.id for r in MARKS(views)] == ["a", "c"]


def test_without_drops_only_that_replica():
    views = [ReplicaView("a"), ReplicaView("home"), ReplicaView("b")]
    assert [r.id for r in without(views, "home")] == ["a", "b"]
    assert without(views, "gone") == views


# -- candidates ----------------------------------------------------------------------------------
def test_sampler_returns_a_small_fleet_whole_minus_unusable():
    views = (ReplicaView("a"), ReplicaView("b", healthy=False), ReplicaView("c"), ReplicaView("d"))
    got = CandidateSampler(16)(Snapshot(views), req(exclude=frozenset({"d"})), random.Random(0))
    assert sorted(r.id for r in got) == ["a", "c"]


def test_sampler_bounds_a_large_fleet_and_puts_prefix_holders_first():
    views = tuple(ReplicaView(f"r{i}") for i in range(1000))
    cached = {"r5": 9_000, "r900": 8_000, "r7": 100}
    got = CandidateSampler(8)(Snapshot(views), req(cached=cached), random.Random(3))
    assert len(got) <= 8
    assert [r.id for r in got[:3]] == ["r5", "r900", "r7"]  # deepest match first


def test_sampler_holders_take_at_most_half_the_candidates():
    views = tuple(ReplicaView(f"r{i}") for i in range(1000))
    cached = {f"r{i}": 5_000 for i in range(20)}  # a shared system prompt on 20 replicas
    got = CandidateSampler(8)(Snapshot(views), req(cached=cached), random.Random(1))
    assert sum(r.id in cached for r in got[:4]) == 4
    assert len(got) == 8  # the other half is a random sample, not more holders by rank


def test_fresh_below_mean_keeps_fresh_usable_unloaded_ones():
    views = (ReplicaView("a", in_flight=6), ReplicaView("b", in_flight=6),
             ReplicaView("f1", fresh=True, in_flight=1),
             ReplicaView("f2", fresh=True, in_flight=5),            # 5 >= 1.0 x mean (4.5)
             ReplicaView("f3", fresh=True, token_usage=0.99),       # over a high-water mark
             ReplicaView("f4", fresh=True, healthy=False))
    snap = Snapshot(views)
    assert [r.id for r in fresh_below_mean(snap, req(), 1.0, MARKS)] == ["f1"]
    assert [r.id for r in fresh_below_mean(snap, req(), 2.0, MARKS)] == ["f1", "f2"]
    assert fresh_below_mean(snap, req(exclude=frozenset({"f1"})), 1.0, MARKS) == []


def test_fresh_below_mean_on_an_idle_fleet_takes_idle_fresh_replicas():
    snap = Snapshot((ReplicaView("a"), ReplicaView("f", fresh=True)))
    assert [r.id for r in fresh_below_mean(snap, req(), 1.0, MARKS)] == ["f"]


# -- scorer --------------------------------------------------------------------------------------
def test_expected_cost_scores_are_the_cost_model_per_candidate():
    p = CostParams()
    views = [ReplicaView("a", num_running_reqs=3), ReplicaView("b", homed_sessions=4, homed_tokens=300_000),
             ReplicaView("c", num_queue_reqs=2)]
    request = req(prompt=50_000, cached={"a": 40_000})
    for placement in (True, False):
        assert ExpectedCost(p, placement)(views, request) == expected_costs(p, views, request, placement=placement)
    # Placement counts the homed KV and sessions; a single overflow request does not.
    placed, overflow = ExpectedCost(p, True)(views, request), ExpectedCost(p, False)(views, request)
    assert placed[1] > overflow[1]
    assert min(range(3), key=placed.__getitem__) == 0  # the prefix holder is cheapest


# -- picker --------------------------------------------------------------------------------------
def test_picker_takes_a_clear_winner_without_drawing():
    views = [ReplicaView("a"), ReplicaView("b")]
    rng = random.Random(0)
    state = rng.getstate()
    assert NearTiePowerOfTwo(0.01, 0.02)(views, [2.0, 1.0], rng).id == "b"
    assert rng.getstate() == state  # no tie, no draw: the rng stream is untouched


def test_picker_breaks_near_ties_by_load_then_homed_kv():
    pick = NearTiePowerOfTwo(0.01, 0.0)
    # 1.0 and 1.005 tie within 1%; 1.5 does not. Of the two ties the less loaded wins.
    views = [ReplicaView("busy", in_flight=3), ReplicaView("idle"), ReplicaView("far")]
    assert {pick(views, [1.0, 1.005, 1.5], random.Random(s)).id for s in range(20)} == {"idle"}
    same_load = [ReplicaView("full", homed_tokens=9), ReplicaView("empty", homed_tokens=1)]
    assert {pick(same_load, [1.0, 1.0], random.Random(s)).id for s in range(20)} == {"empty"}


def test_picker_spreads_exact_ties_instead_of_taking_the_first():
    views = [ReplicaView(str(i)) for i in range(8)]
    picks = {NearTiePowerOfTwo(0.0, 0.0)(views, [1.0] * 8, random.Random(s)).id for s in range(40)}
    assert len(picks) >= 5


def test_picker_absolute_tolerance_widens_ties():
    views = [ReplicaView("a", in_flight=1), ReplicaView("b")]
    assert NearTiePowerOfTwo(0.0, 0.0)(views, [0.01, 0.02], random.Random(0)).id == "a"
    assert NearTiePowerOfTwo(0.0, 0.02)(views, [0.01, 0.02], random.Random(0)).id == "b"


# -- capabilities ----------------------------------------------------------------------------------
def test_every_policy_declares_capabilities():
    for kind in TYPES:
        caps = build_policy(kind).capabilities
        assert isinstance(caps, Capabilities)
        assert caps.uses_affinity is (kind == "coding_agent")


def test_coding_agent_capabilities_mirror_its_params():
    policy = build_policy("coding-agent", {"fresh_until_mean_ratio": 1.5,
                                           "cost": {"capacity_target": 0.8, "default_capacity_tokens": 1000}})
    assert policy.capabilities == Capabilities(uses_affinity=True, fresh_until_mean_ratio=1.5,
                                               capacity_target=0.8, default_capacity_tokens=1000)
    assert build_policy("coding-agent").capabilities.default_capacity_tokens == DEFAULT_CAPACITY_TOKENS


def _engine(policy_name: str, params: dict | None = None) -> RoutingEngine:
    return RoutingEngine(build_policy(policy_name, params), ReplicaRegistry(["r0", "r1"]), ShadowKVIndex(),
                         SessionTable(), random.Random(0))


def test_engine_settles_fresh_replicas_at_the_declared_ratio():
    eng = _engine("coding-agent", {"fresh_until_mean_ratio": 2.0})
    eng.add_replica("r2", now=0)
    for url in ("r0", "r1", "r2"):
        eng.registry.dispatched(url, 0)
    eng.settle_fresh()  # load 1 < 2.0 x mean 1: still fresh (a ratio of 1.0 would settle it)
    assert eng.registry.view("r2").fresh
    for _ in range(3):
        eng.registry.dispatched("r2", 0)
    eng.settle_fresh()  # load 4 >= 2.0 x mean 2
    assert not eng.registry.view("r2").fresh


def test_engine_moves_no_homes_for_a_policy_without_affinity():
    eng = _engine("least-load")
    for i in range(6):
        eng.table.acquire(f"s{i}", 0)
        eng.table.assign(f"s{i}", "r0", force=False, tokens=100_000, now=0)
        eng.table.release(f"s{i}", 0)
    eng.add_replica("r2", now=0)
    assert eng.plan_rebalance(now=1000, min_fresh_age_s=0, max_moves=4, kv_pressure=True) == []


def test_engine_kv_pressure_uses_the_declared_capacity():
    # 6 x 100k tokens homed on r0: within a declared 1M-token capacity nothing needs to move;
    # with the default (444,672) the same fleet moves sessions off r0.
    for params, moved in (({"cost": {"default_capacity_tokens": 1_000_000}}, False), ({}, True)):
        eng = _engine("coding-agent", params)
        for i in range(6):
            eng.table.acquire(f"s{i}", 0)
            eng.table.assign(f"s{i}", "r0", force=False, tokens=100_000, now=0)
            eng.table.release(f"s{i}", 0)
        moves = eng.plan_rebalance(now=1000, min_fresh_age_s=0, max_moves=4, kv_pressure=True)
        assert bool(moves) is moved
