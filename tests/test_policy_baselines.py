"""Baseline policies on hand-built snapshots."""

from __future__ import annotations

import bisect
import random
from collections import Counter

import pytest

from kvrouter.policies.consistent_hash import ConsistentHash, ConsistentHashParams, _h
from kvrouter.policies.domain import ReplicaView, RequestSummary, Snapshot
from kvrouter.policies.registry import build_policy


def snap(n: int, **overrides: ReplicaView) -> Snapshot:
    views = [overrides.get(f"r{i}", ReplicaView(f"r{i}")) for i in range(n)]
    return Snapshot(tuple(views))


def test_consistent_hash_is_sticky_and_remaps_about_one_in_n_on_scale_out():
    policy = build_policy("consistent-hash")
    rng = random.Random(0)
    keys = [f"session-{i}" for i in range(2000)]
    before = {k: policy.decide(snap(10), RequestSummary("/x", session_key=k), rng).replica for k in keys}
    again = {k: policy.decide(snap(10), RequestSummary("/x", session_key=k), rng).replica for k in keys}
    assert before == again
    after = {k: policy.decide(snap(11), RequestSummary("/x", session_key=k), rng).replica for k in keys}
    moved = sum(before[k] != after[k] for k in keys) / len(keys)
    assert 0.04 < moved < 0.16  # ~1/11, and only to the new replica
    assert all(after[k] == "r10" for k in keys if before[k] != after[k])


def test_consistent_hash_skips_unhealthy_without_remapping_others():
    policy = build_policy("consistent-hash")
    rng = random.Random(0)
    keys = [f"s{i}" for i in range(500)]
    base = {k: policy.decide(snap(5), RequestSummary("/x", session_key=k), rng).replica for k in keys}
    down = snap(5, r2=ReplicaView("r2", healthy=False))
    after = {k: policy.decide(down, RequestSummary("/x", session_key=k), rng).replica for k in keys}
    assert all(after[k] == base[k] for k in keys if base[k] != "r2")
    assert "r2" not in after.values()


def test_consistent_hash_remembers_ring_positions_without_changing_a_pick():
    # A returning session's ring position is remembered (bounded: forgotten when full, and when
    # the ring changes): every pick is the one a policy that hashes every key afresh makes,
    # across a scale-out and back.
    remembering, afresh = build_policy("consistent-hash"), build_policy("consistent-hash")
    remembering.MAX_REMEMBERED_KEYS = 50
    rng = random.Random(4)
    keys = [f"session-{i}" for i in range(120)]
    for fleet in (10, 11, 10):
        for _ in range(600):
            request = RequestSummary("/x", session_key=rng.choice(keys))
            afresh._starts.clear()  # hashes and searches every key
            expected = afresh.decide(snap(fleet), request, rng).replica
            assert remembering.decide(snap(fleet), request, rng).replica == expected
            assert len(remembering._starts) <= 50
    assert request.session_key in remembering._starts  # the last key asked is remembered


@pytest.mark.parametrize("replicas, vnodes", [(0, 1), (1, 1), (3, 2), (7, 1000), (100, 160)])
def test_consistent_hash_arc_search_finds_the_whole_ring_bisect(replicas: int, vnodes: int) -> None:
    # A ring position is searched only within its arc (the hash's top bits): it must be the
    # position a bisect of the whole ring finds, for any point, on the points and beside them.
    policy = ConsistentHash(ConsistentHashParams(vnodes=vnodes))
    policy.decide(snap(replicas), RequestSummary("/x", session_key="k"), random.Random(0))
    points = policy._points
    rng = random.Random(replicas)
    probes = [rng.getrandbits(64) for _ in range(5000)] + [0, 2**64 - 1]
    probes += [q for p in points for q in (p - 1, p, p + 1) if 0 <= q < 2**64]
    assert all(policy._position(q) == bisect.bisect(points, q) for q in probes)


@pytest.mark.parametrize("replicas, vnodes", [(1, 1), (3, 2), (100, 160)])
def test_consistent_hash_ring_is_the_members_points_sorted_with_their_owners(replicas: int, vnodes: int) -> None:
    policy = ConsistentHash(ConsistentHashParams(vnodes=vnodes))
    policy.decide(snap(replicas), RequestSummary("/x", session_key="k"), random.Random(0))
    members = sorted(f"r{i}" for i in range(replicas))
    ring = sorted((_h(f"{m}#{i}"), m) for m in members for i in range(vnodes))  # the plain definition
    assert policy._points == [p for p, _ in ring] and policy._owners == [m for _, m in ring]


def test_consistent_hash_ring_orders_tied_points_by_member_as_the_tuples_do(monkeypatch) -> None:
    # 64-bit hashes never tie in practice; a coarse hash makes ties everywhere.
    import kvrouter.policies.consistent_hash as module

    def coarse(data: str) -> int:
        return _h(data) % 50 << 57

    monkeypatch.setattr(module, "_h", coarse)
    policy = ConsistentHash(ConsistentHashParams(vnodes=20))
    policy.decide(snap(7), RequestSummary("/x", session_key="k"), random.Random(0))
    members = sorted(f"r{i}" for i in range(7))
    ring = sorted((coarse(f"{m}#{i}"), m) for m in members for i in range(20))
    assert len(set(policy._points)) < len(policy._points)  # there were ties
    assert policy._points == [p for p, _ in ring] and policy._owners == [m for _, m in ring]


def test_least_load_picks_minimum():
    policy = build_policy("least-load")
    s = snap(3, r0=ReplicaView("r0", in_flight=2), r1=ReplicaView("r1", num_running_reqs=1),
             r2=ReplicaView("r2", in_flight=3))
    assert policy.decide(s, RequestSummary("/x"), random.Random(0)).replica == "r1"


def test_prefix_aware_follows_match_unless_imbalanced():
    policy = build_policy("prefix-aware")
    rng = random.Random(0)
    req = RequestSummary("/x", prompt_tokens=1000, cached_tokens={"r1": 900})
    assert policy.decide(snap(3), req, rng).reason == "prefix_match"
    weak = RequestSummary("/x", prompt_tokens=1000, cached_tokens={"r1": 100})
    assert policy.decide(snap(3), weak, rng).reason == "least_load"
    hot = snap(3, r1=ReplicaView("r1", in_flight=100), r0=ReplicaView("r0", in_flight=1))
    d = policy.decide(hot, req, rng)
    assert d.reason == "imbalanced" and d.replica == "r2"


def test_random_spreads():
    policy = build_policy("random")
    rng = random.Random(3)
    counts = Counter(policy.decide(snap(4), RequestSummary("/x"), rng).replica for _ in range(400))
    assert len(counts) == 4 and min(counts.values()) > 60


def test_prefix_aware_best_holders_match_a_scan_of_the_candidates():
    # The longest usable match above the threshold, ties in snapshot order: what a plain scan of
    # the candidates finds, whichever shortcut finds it (unusable, excluded and tied holders too).
    policy = build_policy("prefix-aware")
    rng = random.Random(7)
    for trial in range(3000):
        n = rng.randint(1, 12)
        views = tuple(ReplicaView(f"r{i}", healthy=rng.random() > 0.15) for i in range(n))
        # With the id index the registry builds, and without it (hand-built snapshots).
        snapshot = Snapshot(views, by_id={v.id: v for v in views}) if trial % 2 else Snapshot(views)
        holders = rng.sample(range(n), rng.randint(1, n))
        cached = {f"r{i}": rng.choice((10, 40, 80, 80, 100, rng.randint(0, 100))) for i in holders}
        if rng.random() < 0.2:
            cached["r-gone"] = 100  # a holder the snapshot no longer has
        exclude = frozenset(f"r{i}" for i in range(n) if rng.random() < 0.1)
        request = RequestSummary("/x", prompt_tokens=100, cached_tokens=cached, exclude=exclude)
        floor = policy.params.cache_threshold * 100
        usable = [v.id for v in views if v.healthy and v.id not in exclude and cached.get(v.id, 0) > floor]
        best = max((cached[r] for r in usable), default=None)
        expected = [r for r in usable if cached[r] == best]
        assert policy._best_holders(snapshot, request) == expected
