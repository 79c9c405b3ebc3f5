"""Shadow policies share the live decision's per-snapshot work (the fleet scan) without changing
any answer: a policy asked as a shadow picks what it picks live, on random fleets, and the
shared scans and the faster loops give the results the plain definitions give."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import pytest

from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.policies.domain import ReplicaView, RequestSummary, SessionView, Snapshot
from kvrouter.policies.registry import build_policy
from kvrouter.router.engine import RoutingEngine
from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.router.sessions import SessionTable
from kvrouter.sglang_protocol.signals import ReplicaSignals

BUILT_IN = ("coding-agent", "prefix-aware", "least-load", "round-robin", "consistent-hash", "random")


def random_view(rng: random.Random, rid: str) -> ReplicaView:
    polled = rng.random() < 0.8
    return ReplicaView(
        rid, healthy=rng.random() < 0.85, fresh=rng.random() < 0.1, in_flight=rng.randrange(0, 6),
        num_running_reqs=rng.randrange(0, 50) if polled else None,
        num_queue_reqs=rng.randrange(0, 4) if polled else None,
        token_usage=rng.random() if polled else None,
        max_total_num_tokens=rng.choice((None, 200_000, 500_000)),
        homed_sessions=rng.randrange(0, 5), homed_tokens=rng.randrange(0, 400_000))


FLEETS = (1, 3, 8, 40, 120)  # replicas; 120 > 4 x 16 candidates: coding-agent samples


def cases(rng: random.Random, per_fleet: int) -> Iterator[tuple[Snapshot, RequestSummary]]:
    """Random (snapshot, request) pairs, fleet size by fleet size (a hash ring is built once each)."""
    for n in FLEETS:
        for _ in range(per_fleet):
            yield random_case(rng, n)


def random_case(rng: random.Random, n: int) -> tuple[Snapshot, RequestSummary]:
    views = tuple(random_view(rng, f"r{i}") for i in range(n))
    ids = [v.id for v in views]
    prompt = rng.choice((0, 100, 5_000, 100_000))
    holders = rng.sample(ids + ["gone"], min(len(ids) + 1, rng.randrange(0, 6)))
    # Equal matches happen (a system prompt every replica holds): draw from few values.
    cached = {rid: rng.choice((0, prompt // 4, prompt // 2, prompt)) for rid in holders}
    exclude = frozenset(rng.sample(ids, rng.randrange(0, min(3, n) + 1)) if rng.random() < 0.3 else ())
    session = None
    if rng.random() < 0.7:
        session = SessionView(f"s{rng.randrange(10**6)}", home=rng.choice(ids + [None, "gone"]),
                              in_flight=rng.randrange(0, 4))
    request = RequestSummary("/v1/chat/completions", session_key=session.key if session else None,
                             prompt_tokens=prompt, exclude=exclude,
                             prefix_blocks=(rng.getrandbits(63),) if rng.random() < 0.5 else (),
                             cached_tokens=cached)
    healthy = [v for v in views if v.healthy]
    snapshot = Snapshot(views, session, {v.id: v for v in views}, sum(v.load for v in healthy),
                        len(healthy), tuple(v.id for v in views if v.fresh), epoch=n)
    return snapshot, request


def fresh_copy(snapshot: Snapshot) -> Snapshot:
    """The same snapshot with nothing memoised yet."""
    return Snapshot(snapshot.replicas, snapshot.session, snapshot.by_id, snapshot.healthy_load,
                    snapshot.healthy_count, snapshot.fresh, snapshot.epoch)


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_policy_decides_the_same_after_other_policies_used_the_snapshot(name: str) -> None:
    # One instance decides on an untouched snapshot, its twin (same state, same seed) on one
    # every other built-in policy already decided on: the memoised scans change nothing.
    rng = random.Random(7)
    alone, shared = build_policy(name), build_policy(name)
    others = [build_policy(other) for other in BUILT_IN]
    rng_alone, rng_shared, rng_others = random.Random(1), random.Random(1), random.Random(2)
    for snapshot, request in cases(rng, 60):
        for other in others:
            other.decide(snapshot, request, rng_others)
        assert (alone.decide(fresh_copy(snapshot), request, rng_alone)
                == shared.decide(snapshot, request, rng_shared))


def plain_least_load(snapshot: Snapshot, request: RequestSummary, rng: random.Random) -> str | None:
    candidates = [r for r in snapshot.replicas if r.healthy and r.id not in request.exclude]
    if not candidates:
        return None
    low = min(r.load for r in candidates)
    return rng.choice([r for r in candidates if r.load == low]).id


def plain_prefix_aware(snapshot: Snapshot, request: RequestSummary, rng: random.Random) -> str | None:
    """The gateway rule written out over every candidate (defaults 0.3, 64, 1.5)."""
    candidates = [r for r in snapshot.replicas if r.healthy and r.id not in request.exclude]
    if not candidates:
        return None
    loads = [r.load for r in candidates]
    lo, hi = min(loads), max(loads)
    least = [r for r in candidates if r.load == lo]
    if hi - lo > 64 and hi > 1.5 * lo:
        return rng.choice(least).id
    if request.prompt_tokens > 0 and request.cached_tokens:
        matched = [(request.cached_tokens.get(r.id, 0), r) for r in candidates]
        best = max(m for m, _ in matched)
        if best > 0.3 * request.prompt_tokens:
            return rng.choice([r for m, r in matched if m == best]).id
    return rng.choice(least).id


@pytest.mark.parametrize("name, plain", [("least-load", plain_least_load), ("prefix-aware", plain_prefix_aware)])
def test_scan_based_policies_match_their_plain_definition(name, plain) -> None:
    rng = random.Random(11)
    policy = build_policy(name)
    rng_policy, rng_plain = random.Random(3), random.Random(3)
    for snapshot, request in cases(rng, 100):
        decision = policy.decide(snapshot, request, rng_policy)
        assert (decision.replica if decision else None) == plain(snapshot, request, rng_plain)


def test_a_view_load_is_the_larger_of_polled_and_own_in_flight() -> None:
    assert ReplicaView("a", in_flight=3).load == 3
    assert ReplicaView("a", in_flight=3, num_running_reqs=1, num_queue_reqs=1).load == 3
    assert ReplicaView("a", in_flight=3, num_running_reqs=4).load == 4
    view = dataclasses.replace(ReplicaView("a", in_flight=1), num_running_reqs=5, num_queue_reqs=2)
    assert view.load == 7  # derived again for every new view
    assert ReplicaView("a", in_flight=2) == ReplicaView("a", in_flight=2)


def test_the_fleet_scan_is_made_once_per_snapshot_and_exclusion_set() -> None:
    snapshot, request = Snapshot(tuple(ReplicaView(f"r{i}", in_flight=i % 3) for i in range(6))), \
        RequestSummary("/x")
    scan = snapshot.load_scan(request)
    assert snapshot.with_session(SessionView("s")).load_scan(request) is scan  # shared
    assert [r.id for r in scan.least] == ["r0", "r3"] and (scan.low, scan.high) == (0, 2)
    retry = dataclasses.replace(request, exclude=frozenset({"r0"}))
    assert [r.id for r in snapshot.load_scan(retry).least] == ["r3"]
    assert snapshot.candidates(retry) == [r for r in snapshot.replicas if r.id != "r0"]


def test_choice_draws_what_randrange_draws() -> None:
    # Candidate sampling relies on it to leave every seeded run unchanged.
    seq = tuple(range(100))
    a, b = random.Random(5), random.Random(5)
    assert [a.choice(seq) for _ in range(500)] == [seq[b.randrange(len(seq))] for _ in range(500)]


@pytest.mark.parametrize("replicas", [12, 100])  # 100 > 4 x 16: coding-agent samples the fleet
@pytest.mark.parametrize("name", BUILT_IN)
def test_a_shadow_of_the_live_policy_agrees_on_every_decision(name: str, replicas: int) -> None:
    # Live and shadow instances of the same policy, their random streams seeded alike, on a
    # fleet that changes between decisions (dispatches, polls, health, sessions, cached prefixes):
    # the shadow decides after the live policy on the same snapshot and views, reading what the
    # live decision left (fleet scans, cost terms), and must still pick what it picks live.
    urls = [f"http://r{i}" for i in range(replicas)]
    engine = RoutingEngine(build_policy(name), ReplicaRegistry(urls), ShadowKVIndex(), SessionTable(),
                           random.Random(0), metrics=RouterMetrics())
    engine.shadows = ((name, build_policy(name)),)
    rng = random.Random(5)
    placements = []
    for i in range(300):
        url = rng.choice(urls)
        if rng.random() < 0.3:
            engine.registry.update_signals(url, ReplicaSignals(
                num_running_reqs=rng.randrange(0, 40), num_queue_reqs=rng.randrange(0, 3),
                token_usage=rng.random(), max_total_num_tokens=400_000))
        if rng.random() < 0.05:
            engine.registry.record_failure(url)
        elif rng.random() < 0.2:
            engine.registry.record_success(url)
        blocks = tuple(range(rng.randrange(0, 4), rng.randrange(4, 40)))
        if rng.random() < 0.3:
            engine.index.record(rng.choice(urls), blocks)
        key = f"s{rng.randrange(30)}" if rng.random() < 0.7 else None
        summary = RequestSummary("/v1/chat/completions", session_key=key,
                                 prompt_tokens=len(blocks) * 64, prefix_blocks=blocks)
        p = engine.place(summary, engine.table.view(key) if key else None)
        if p is None:
            continue
        assert p.notes is not None
        (_, shadow, _), = p.notes.shadows
        assert shadow == p.decision, i
        placements.append(p)
        if len(placements) > 20:
            placements.pop(rng.randrange(len(placements))).done()
    reg = engine.metrics.registry
    assert reg.get_sample_value("kvrouter_shadow_decisions_total", {"shadow": name, "agrees": "false"}) is None
    assert reg.get_sample_value("kvrouter_shadow_decisions_total", {"shadow": name, "agrees": "true"}) > 200


@pytest.mark.parametrize("replicas", [100, 300])  # > 4 x 16 candidates: coding-agent samples
@pytest.mark.parametrize("name", BUILT_IN)
def test_a_shadow_agrees_with_the_live_policy_on_new_sessions_in_a_large_fleet(name: str, replicas: int) -> None:
    # Mostly new sessions with prompts nobody holds (coding-agent's sampled, filtered and costed
    # placement over many candidates), on a polled fleet where some replicas sit above their
    # high-water marks, homes accumulate, fresh replicas join and health comes and goes (so the
    # sampling sees every replica usable, and not): the shadow, deciding on the same snapshot
    # after the live decision, picks what the live policy picks.
    urls = [f"http://r{i}" for i in range(replicas)]
    engine = RoutingEngine(build_policy(name), ReplicaRegistry(urls), ShadowKVIndex(), SessionTable(),
                           random.Random(0), metrics=RouterMetrics())  # seeded as the shadows' stream
    engine.shadows = ((name, build_policy(name)),)
    rng = random.Random(9)
    for url in urls:
        engine.registry.update_signals(url, ReplicaSignals(
            num_running_reqs=rng.randrange(0, 45), num_queue_reqs=rng.randrange(0, 4),
            token_usage=rng.random(), max_total_num_tokens=rng.choice((400_000, 500_000))))
    placements, returning, down = [], [], []
    decided = 0
    for i in range(400):
        url = rng.choice(urls)
        if rng.random() < 0.2:
            engine.registry.update_signals(url, ReplicaSignals(
                num_running_reqs=rng.randrange(0, 45), num_queue_reqs=rng.randrange(0, 4),
                token_usage=rng.random(), max_total_num_tokens=400_000))
        if rng.random() < 0.05:  # down for a while: the sample skips it
            for _ in range(3):
                engine.registry.record_failure(url)
            down.append(url)
        elif down and rng.random() < 0.3:
            engine.registry.record_success(down.pop(rng.randrange(len(down))))
        if i in (150, 300):  # fresh replicas take new sessions until they reach the mean load
            engine.add_replica(f"http://fresh{i}", now=0.0)
        if returning and rng.random() < 0.2:
            key, blocks = rng.choice(returning)
        else:  # a new session: a prompt nobody holds
            key, blocks = f"new{i}", tuple(rng.getrandbits(63) for _ in range(rng.randrange(1, 40)))
        summary = RequestSummary("/v1/chat/completions", session_key=key,
                                 prompt_tokens=len(blocks) * rng.choice((64, 2000, 6000)), prefix_blocks=blocks)
        p = engine.place(summary, engine.table.view(key))
        if p is None:
            continue
        (_, shadow, _), = p.notes.shadows
        assert shadow == p.decision, i
        decided += 1
        if rng.random() < 0.5:
            p.accepted()
            returning.append((key, blocks))
        placements.append(p)
        if len(placements) > 30:
            placements.pop(rng.randrange(len(placements))).done()
    assert decided > 350


def test_the_registry_hands_snapshots_the_loads_of_their_views() -> None:
    # Least-load and prefix-aware scan the registry's loads instead of the views: after any
    # sequence of membership, dispatch, poll and health changes they must be the views' loads.
    rng = random.Random(13)
    registry = ReplicaRegistry([f"http://r{i}" for i in range(8)])
    plain_rng, policy_rng = random.Random(4), random.Random(4)
    least_load = build_policy("least-load")
    for step in range(600):
        urls = registry.urls()
        url = rng.choice(urls) if urls else "http://r0"
        action = rng.random()
        if action < 0.05:
            registry.remove(url)
        elif action < 0.1:
            registry.add(f"http://r{rng.randrange(12)}", fresh=rng.random() < 0.5)
        elif action < 0.4:
            registry.dispatched(url, rng.randrange(100))
        elif action < 0.6:
            registry.completed(url, 0)
        elif action < 0.8:
            registry.update_signals(url, ReplicaSignals(num_running_reqs=rng.randrange(0, 9),
                                                        num_queue_reqs=rng.randrange(0, 3)))
        elif action < 0.9:
            registry.record_failure(url)
        else:
            registry.record_success(url)
        snapshot = registry.snapshot()
        assert snapshot.loads == tuple(v.load for v in snapshot.replicas), step
        request = RequestSummary("/x")
        decision = least_load.decide(snapshot, request, policy_rng)
        assert (decision.replica if decision else None) == plain_least_load(snapshot, request, plain_rng)
