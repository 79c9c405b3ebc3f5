"""coding_agent's rules on hand-built snapshots: no servers, no clocks, seeded rng."""

from __future__ import annotations

import random

import pytest

from kvrouter.policies.domain import ReplicaView, RequestSummary, SessionView, Snapshot
from kvrouter.policies.coding_agent import CodingAgent, CodingAgentParams
from kvrouter.policies.registry import build_policy

P = CodingAgent()


def req(prompt: int = 100_000, cached: dict[str, int] | None = None, **kw) -> RequestSummary:
    return RequestSummary(route="/v1/chat/completions", session_key=kw.pop("key", "s1"),
                          prompt_tokens=prompt, cached_tokens=cached or {}, **kw)


def decide(replicas, request, session=None, seed=0):
    return P.decide(Snapshot(tuple(replicas), session), request, random.Random(seed))


def test_affinity_sends_a_session_home():
    reps = [ReplicaView("a", in_flight=5), ReplicaView("b"), ReplicaView("c")]
    d = decide(reps, req(cached={"a": 98_000}), SessionView("s1", home="a", in_flight=0))
    assert (d.replica, d.reason, d.home) == ("a", "affinity", None)


def test_session_over_high_water_overflows_to_cheapest_other_and_keeps_home():
    # 8 branches of a 10k-token session: queueing behind 7 siblings costs more than a cold
    # 10k prefill elsewhere, so this one is shed to the least-loaded other replica.
    reps = [ReplicaView("a", in_flight=7), ReplicaView("b", in_flight=3), ReplicaView("c")]
    d = decide(reps, req(prompt=10_000, cached={"a": 9_000}), SessionView("s1", home="a", in_flight=7))
    assert d.reason == "overflow" and d.replica == "c" and d.home is None


def test_over_high_water_stays_home_when_a_cold_prefill_would_cost_more():
    # 3 branches of a 100k-token session: two warm sibling prefills (~0.2 s each) at home beat
    # recomputing 100k tokens elsewhere (~5 s), so shedding would only hurt.
    reps = [ReplicaView("a", in_flight=2), ReplicaView("b"), ReplicaView("c")]
    d = decide(reps, req(cached={"a": 98_000}), SessionView("s1", home="a", in_flight=2))
    assert (d.replica, d.reason) == ("a", "affinity")


@pytest.mark.parametrize("home", [
    ReplicaView("a", num_running_reqs=45, num_queue_reqs=0),   # running high-water
    ReplicaView("a", num_running_reqs=10, num_queue_reqs=5),   # queue high-water
    ReplicaView("a", num_running_reqs=3, token_usage=0.97),    # KV high-water
])
def test_overloaded_home_overflows(home):
    d = decide([home, ReplicaView("b"), ReplicaView("c", in_flight=2)], req(prompt=4_000),
               SessionView("s1", home="a"))
    assert d.reason == "overflow" and d.replica == "b"


def test_unhealthy_home_rehomes_by_cost():
    reps = [ReplicaView("a", healthy=False), ReplicaView("b", in_flight=4), ReplicaView("c")]
    d = decide(reps, req(), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("c", "rehome", "c")


def test_retry_after_home_failed_keeps_home():
    reps = [ReplicaView("a"), ReplicaView("b")]
    d = decide(reps, req(exclude=frozenset({"a"})), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("b", "retry", None)


def test_new_session_goes_where_its_prefix_is_cached():
    # Same load everywhere; "b" already holds 60k tokens of this prompt (shared repo context).
    reps = [ReplicaView("a"), ReplicaView("b"), ReplicaView("c")]
    d = decide(reps, req(cached={"b": 60_000}), SessionView("s1"))
    assert (d.replica, d.reason, d.home) == ("b", "new_session", "b")


def test_new_session_avoids_queue_and_kv_overcommit():
    reps = [
        ReplicaView("busy", num_running_reqs=30, num_queue_reqs=2),
        ReplicaView("full", homed_tokens=430_000, max_total_num_tokens=444_672),
        ReplicaView("ok", num_running_reqs=4, homed_tokens=100_000, max_total_num_tokens=444_672),
    ]
    d = decide(reps, req(), SessionView("s1"))
    assert d.replica == "ok"


def test_fresh_replica_preferred_until_it_reaches_the_mean():
    reps = [ReplicaView("a", in_flight=6), ReplicaView("b", in_flight=6),
            ReplicaView("new", fresh=True, in_flight=1)]
    d = decide(reps, req(), SessionView("s1"))
    assert (d.replica, d.reason) == ("new", "fresh_replica")
    reps[2] = ReplicaView("new", fresh=True, in_flight=6)  # now at the mean: ordinary placement
    assert decide(reps, req(), SessionView("s1")).reason == "new_session"


def test_ties_broken_by_power_of_two_not_index_order():
    reps = [ReplicaView(str(i)) for i in range(8)]
    picks = {decide(reps, req(), SessionView("s1"), seed=s).replica for s in range(40)}
    assert len(picks) >= 5  # many replicas win across seeds, not always the first


def test_p2c_prefers_lower_load_among_ties():
    # Costs tie within tolerance; of any two sampled, the lower-load one wins, so the busiest never does.
    reps = [ReplicaView("x", in_flight=1), ReplicaView("y", in_flight=0), ReplicaView("z", in_flight=1)]
    picks = [decide(reps, req(prompt=1000), SessionView("s1"), seed=s).replica for s in range(30)]
    assert "y" in picks and picks.count("y") > picks.count("x")


def test_all_overloaded_falls_back_to_cheapest():
    reps = [ReplicaView("a", num_running_reqs=48, num_queue_reqs=9),
            ReplicaView("b", num_running_reqs=48, num_queue_reqs=3)]
    d = decide(reps, req(), SessionView("s1"))
    assert (d.replica, d.reason) == ("b", "fallback")


def test_stale_signals_fall_back_to_own_in_flight():
    # Polled signals unknown (None) on "a": its load is this router's in-flight count.
    reps = [ReplicaView("a", in_flight=7), ReplicaView("b", num_running_reqs=2, in_flight=0)]
    assert reps[0].load == 7 and reps[1].load == 2
    assert decide(reps, req(), SessionView("s1")).replica == "b"


def test_keyless_request_treats_the_prefix_holder_as_home():
    reps = [ReplicaView("a"), ReplicaView("b", in_flight=3)]
    d = decide(reps, req(key=None, cached={"b": 90_000}))
    assert (d.replica, d.reason, d.home) == ("b", "affinity", None)


def test_no_candidates_means_none():
    assert decide([ReplicaView("a", healthy=False)], req(), SessionView("s1")) is None


def test_large_fleet_costs_a_bounded_sample_including_prefix_holder():
    reps = [ReplicaView(f"r{i}", in_flight=3) for i in range(1000)]
    reps[777] = ReplicaView("r777", in_flight=3)
    d = decide(reps, req(cached={"r777": 99_000}), SessionView("s1"))
    assert d.replica == "r777"


def test_params_parse_and_reject_bad_values():
    policy = build_policy("coding-agent", {"session_high_water": 4, "cost": {"queue_s_per_waiting": 1}})
    assert isinstance(policy, CodingAgent)
    assert policy.params.session_high_water == 4 and policy.params.cost.queue_s_per_waiting == 1
    assert policy.params.replica_max_queue == CodingAgentParams().replica_max_queue
    with pytest.raises(ValueError, match="session_high_water"):
        build_policy("coding-agent", {"session_high_water": 0})
    with pytest.raises(ValueError, match="bogus"):
        build_policy("coding-agent", {"bogus": 1})


def test_overflow_compares_waiting_not_placement_terms():
    # 2 siblings at home on a 100k-token session; the home carries 30 homed sessions. Homed
    # sessions are future load, not this request's wait: it stays warm at home.
    reps = [ReplicaView("a", in_flight=2, homed_sessions=30, homed_tokens=400_000),
            ReplicaView("b"), ReplicaView("c")]
    d = decide(reps, req(cached={"a": 98_000}), SessionView("s1", home="a", in_flight=2))
    assert (d.replica, d.reason) == ("a", "affinity")


def test_keyless_request_skips_an_unusable_best_holder():
    reps = [ReplicaView("a", healthy=False), ReplicaView("b"), ReplicaView("f", fresh=True)]
    d = decide(reps, req(key=None, cached={"a": 100_000, "b": 99_000}))
    assert (d.replica, d.reason) == ("b", "affinity")


def test_an_overloaded_fresh_replica_takes_no_new_sessions():
    reps = [ReplicaView("a", token_usage=0.3), ReplicaView("b", token_usage=0.3),
            ReplicaView("f", fresh=True, token_usage=0.97)]
    d = decide(reps, req(), SessionView("s1"))
    assert d.replica in {"a", "b"} and d.reason == "new_session"


def test_batched_costs_equal_one_by_one():
    """The ExpectedCost step costs its candidates in one loop (policies/cost.py: expected_costs); each value
    must be exactly the single-replica cost, with the home's own context not counted twice."""
    from kvrouter.policies.cost import CostParams, expected_cost, expected_costs

    rng = random.Random(7)
    p = CostParams()
    for _ in range(300):
        replicas = [ReplicaView(id=f"r{i}", in_flight=rng.randrange(60),
                                num_running_reqs=rng.choice([None, rng.randrange(60)]),
                                num_queue_reqs=rng.choice([None, rng.randrange(5)]),
                                token_usage=rng.choice([None, rng.random()]),
                                max_total_num_tokens=rng.choice([None, 200_000]),
                                homed_sessions=rng.randrange(6), homed_tokens=rng.randrange(600_000))
                    for i in range(6)]
        request = RequestSummary("/v1/chat/completions", prompt_tokens=rng.randrange(1, 200_000),
                                 cached_tokens={f"r{i}": rng.randrange(250_000) for i in range(0, 6, 2)},
                                 host_cached_tokens={"r1": rng.randrange(250_000)})
        for placement in (True, False):
            batch = expected_costs(p, replicas, request, home="r2", placement=placement)
            singles = [expected_cost(p, r, request, is_home=r.id == "r2", placement=placement) for r in replicas]
            assert batch == singles


# -- rehome_evicted: the home's cache for the session is gone ------------------------------------
BLOCKS = tuple(range(1, 50))  # a prompt with prefix blocks: the KV index was consulted


def test_home_that_lost_the_sessions_prefix_rehomes_where_it_starts_soonest():
    # The index says "a" keeps 10k of the 100k-token prompt (the engine evicted the rest): the
    # request is a near-cold prefill anywhere, and at "a" it would wait behind two queued requests
    # (still under the high-water marks), so it and the home move to the idle "c".
    reps = [ReplicaView("a", num_running_reqs=4, num_queue_reqs=2), ReplicaView("b", in_flight=2), ReplicaView("c")]
    d = decide(reps, req(cached={"a": 10_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("c", "rehome_evicted", "c")


def test_home_that_lost_the_prefix_moves_to_a_replica_that_holds_it():
    reps = [ReplicaView("a"), ReplicaView("b", in_flight=1), ReplicaView("c")]
    d = decide(reps, req(cached={"a": 5_000, "b": 95_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("b", "rehome_evicted", "b")


def test_home_that_lost_the_prefix_keeps_ties():
    reps = [ReplicaView("a", in_flight=1), ReplicaView("b", in_flight=1), ReplicaView("c", in_flight=1)]
    d = decide(reps, req(cached={"a": 10_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("a", "affinity", None)


@pytest.mark.parametrize("params,cached", [
    ({}, 60_000),  # the home still holds most of the prompt: it stays home, however busy
    ({"home_lost_fraction": 0.0}, 0),  # the rule turned off
])
def test_home_that_keeps_the_prefix_or_rule_off_stays_home(params, cached):
    policy = CodingAgent(CodingAgentParams(**params))
    reps = [ReplicaView("a", in_flight=3), ReplicaView("b"), ReplicaView("c")]
    d = policy.decide(Snapshot(tuple(reps), SessionView("s1", home="a")),
                      req(cached={"a": cached}, prefix_blocks=BLOCKS), random.Random(0))
    assert (d.replica, d.reason, d.home) == ("a", "affinity", None)


def test_without_prefix_blocks_the_home_is_not_judged_by_the_index():
    # No prefix blocks: no index match was made, so an empty cached map says nothing.
    reps = [ReplicaView("a", in_flight=3), ReplicaView("b"), ReplicaView("c")]
    d = decide(reps, req(cached={}), SessionView("s1", home="a"))
    assert (d.replica, d.reason) == ("a", "affinity")


def test_new_session_takes_a_replica_no_session_calls_home_over_a_shared_system_prompt():
    # "a" homes two sessions and holds the 57k-token system prompt every session starts with
    # (1.5 characters per token); "b" and "c" home none. The prompt is cheaper to prefill on "a"
    # (by ~0.7 s, once), but every later turn of the new session would queue behind its
    # neighbours' there, and their KV would evict each other's.
    reps = [ReplicaView("a", homed_sessions=2, homed_tokens=120_000, max_total_num_tokens=577_000),
            ReplicaView("b", max_total_num_tokens=577_000), ReplicaView("c", max_total_num_tokens=577_000)]
    request = req(prompt=57_000, cached={"a": 38_000})
    d = decide(reps, request, SessionView("s1"))
    assert d.reason == "empty_replica" and d.replica in ("b", "c") and d.home == d.replica
    off = CodingAgent(CodingAgentParams(empty_replica_max_extra_s=0))
    d = off.decide(Snapshot(tuple(reps), SessionView("s1")), request, random.Random(0))
    assert (d.replica, d.reason) == ("a", "new_session")


def test_a_fleets_second_session_takes_an_empty_replica_not_the_first_sessions_one():
    # The fleet's first session lives on "a", which holds the system prompt; "b" and "c" home
    # none. Paired on "a" to save that prefix once, the first sessions (by the time later ones
    # arrive, the longest) would share a replica's KV and queue while two replicas sat idle.
    reps = [ReplicaView("a", homed_sessions=1, homed_tokens=60_000, max_total_num_tokens=577_000),
            ReplicaView("b", max_total_num_tokens=577_000), ReplicaView("c", max_total_num_tokens=577_000)]
    d = decide(reps, req(prompt=57_000, cached={"a": 38_000}), SessionView("s1"))
    assert d.reason == "empty_replica" and d.replica in ("b", "c") and d.home == d.replica
    # With no replica left empty, the cost decides as before.
    full = [ReplicaView(r.id, homed_sessions=1, homed_tokens=60_000, max_total_num_tokens=577_000)
            for r in reps]
    d = decide(full, req(prompt=57_000, cached={"a": 38_000}), SessionView("s1"))
    assert (d.replica, d.reason) == ("a", "new_session")


def test_empty_replica_yields_when_it_costs_far_more_or_is_overloaded():
    # "a" holds 90k of a 100k prompt (a shared repository context): a cold 100k prefill on the
    # empty replica costs seconds more than the limit, so ordinary placement keeps it.
    reps = [ReplicaView("a", homed_sessions=2, homed_tokens=20_000), ReplicaView("c")]
    d = decide(reps, req(cached={"a": 90_000}), SessionView("s1"))
    assert (d.replica, d.reason) == ("a", "new_session")
    # An empty replica over a high-water mark takes nothing.
    reps = [ReplicaView("a", homed_sessions=2), ReplicaView("c", num_running_reqs=3, num_queue_reqs=5)]
    d = decide(reps, req(prompt=21_000, cached={"a": 15_000}), SessionView("s1"))
    assert (d.replica, d.reason) == ("a", "new_session")
    # Keyless requests set no home, so they never count as a replica's first session.
    d = decide([ReplicaView("a", homed_sessions=2), ReplicaView("c")],
               req(prompt=21_000, cached={"a": 15_000}, key=None), None)
    assert d.reason != "empty_replica"


# -- an overloaded home that lost the prefix: the home moves with the request --------------------
def test_overloaded_home_that_lost_the_prefix_moves_the_home_with_the_request():
    # Over the KV high-water mark and holding 10k of the 100k-token prompt: the request is cold
    # anywhere. Shed as overflow (home kept) its KV would land on "c" while the next turn went
    # back to "a" and was cold again; placed as rehome_evicted, the home follows it to "c".
    reps = [ReplicaView("a", num_running_reqs=3, num_queue_reqs=3), ReplicaView("b", in_flight=2), ReplicaView("c")]
    d = decide(reps, req(cached={"a": 10_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("c", "rehome_evicted", "c")


def test_overloaded_home_that_lost_the_prefix_stays_when_every_other_is_over_its_marks():
    reps = [ReplicaView("a", num_running_reqs=3, num_queue_reqs=3),
            ReplicaView("b", num_running_reqs=3, num_queue_reqs=4), ReplicaView("c", num_running_reqs=45)]
    d = decide(reps, req(cached={"a": 10_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("a", "affinity", None)


def test_overloaded_home_that_keeps_the_prefix_or_a_busy_session_still_overflows():
    reps = [ReplicaView("a", num_running_reqs=10, num_queue_reqs=5), ReplicaView("b"), ReplicaView("c", in_flight=2)]
    d = decide(reps, req(prompt=4_000, cached={"a": 3_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("b", "overflow", None)
    reps = [ReplicaView("a", in_flight=7), ReplicaView("b", in_flight=3), ReplicaView("c")]
    d = decide(reps, req(prompt=10_000, cached={"a": 1_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a", in_flight=7))
    assert (d.replica, d.reason, d.home) == ("c", "overflow", None)


def test_lost_home_moves_with_shed_off_sheds_as_overflow():
    policy = CodingAgent(CodingAgentParams(lost_home_moves_with_shed=False))
    reps = [ReplicaView("a", num_running_reqs=3, num_queue_reqs=3), ReplicaView("b", in_flight=2), ReplicaView("c")]
    d = policy.decide(Snapshot(tuple(reps), SessionView("s1", home="a")),
                      req(cached={"a": 10_000}, prefix_blocks=BLOCKS), random.Random(0))
    assert (d.replica, d.reason, d.home) == ("c", "overflow", None)


# -- stay_no_room: a session whose home lost it moves only where its KV has room -----------------
CAP = 266_496  # KV tokens of the demo profile's replica: room for ~2.7 sessions of 100k


def test_home_that_lost_the_prefix_stays_when_no_other_replica_has_kv_room():
    # As in the rehome_evicted case above, but the other replicas' running requests already fill
    # most of their KV: a 100k-token cold prefill there would evict the idle sessions' prefixes.
    reps = [ReplicaView("a", num_running_reqs=4, num_queue_reqs=2, max_total_num_tokens=CAP),
            ReplicaView("b", in_flight=2, token_usage=0.7, max_total_num_tokens=CAP),
            ReplicaView("c", token_usage=0.6, max_total_num_tokens=CAP)]
    d = decide(reps, req(cached={"a": 10_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("a", "stay_no_room", None)


def test_home_that_lost_the_prefix_moves_to_the_replica_with_kv_room():
    reps = [ReplicaView("a", num_running_reqs=4, num_queue_reqs=2, max_total_num_tokens=CAP),
            ReplicaView("b", token_usage=0.7, max_total_num_tokens=CAP),
            ReplicaView("c", in_flight=1, token_usage=0.3, max_total_num_tokens=CAP)]
    d = decide(reps, req(cached={"a": 10_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("c", "rehome_evicted", "c")


def test_home_that_lost_the_prefix_moves_warm_to_a_replica_without_room():
    reps = [ReplicaView("a", max_total_num_tokens=CAP),
            ReplicaView("b", in_flight=1, token_usage=0.8, max_total_num_tokens=CAP),
            ReplicaView("c", token_usage=0.8, max_total_num_tokens=CAP)]
    d = decide(reps, req(cached={"a": 5_000, "b": 95_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("b", "rehome_evicted", "b")


def test_rehome_needs_kv_room_off_moves_as_before():
    policy = CodingAgent(CodingAgentParams(rehome_needs_kv_room=False))
    reps = [ReplicaView("a", num_running_reqs=4, num_queue_reqs=2, max_total_num_tokens=CAP),
            ReplicaView("b", in_flight=2, token_usage=0.7, max_total_num_tokens=CAP),
            ReplicaView("c", token_usage=0.6, max_total_num_tokens=CAP)]
    d = policy.decide(Snapshot(tuple(reps), SessionView("s1", home="a")),
                      req(cached={"a": 10_000}, prefix_blocks=BLOCKS), random.Random(0))
    assert (d.replica, d.reason, d.home) == ("c", "rehome_evicted", "c")


def test_overloaded_home_that_lost_the_prefix_moves_with_one_sibling_in_flight():
    # Busy means `session_high_water` (2) requests in flight: one sibling still lets the home
    # move with the request, as the rule's docs say.
    reps = [ReplicaView("a", num_running_reqs=3, num_queue_reqs=3), ReplicaView("b", in_flight=2), ReplicaView("c")]
    d = decide(reps, req(cached={"a": 10_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a", in_flight=1))
    assert (d.replica, d.reason, d.home) == ("c", "rehome_evicted", "c")


def test_kv_room_of_replicas_without_the_signals_and_of_a_prompt_larger_than_any_kv():
    # No token_usage reported: counted as none in use (as the high-water marks count it), so
    # the move goes ahead; a prompt over the mark of every replica's KV never moves cold.
    reps = [ReplicaView("a", num_running_reqs=4, num_queue_reqs=2, max_total_num_tokens=CAP),
            ReplicaView("b", in_flight=1), ReplicaView("c")]
    d = decide(reps, req(cached={"a": 10_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a"))
    assert (d.replica, d.reason) in {("b", "rehome_evicted"), ("c", "rehome_evicted")}
    d = decide(reps, req(prompt=600_000, cached={"a": 10_000}, prefix_blocks=BLOCKS), SessionView("s1", home="a"))
    assert (d.replica, d.reason, d.home) == ("a", "stay_no_room", None)
