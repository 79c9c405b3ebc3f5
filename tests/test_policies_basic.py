"""round_robin and random on hand-built snapshots."""

from __future__ import annotations

import random

import pytest

from kvrouter.policies.domain import ReplicaView, RequestSummary, Snapshot
from kvrouter.policies.registry import build_policy


def snap(*views: ReplicaView) -> Snapshot:
    return Snapshot(tuple(views))


REQ = RequestSummary(route="/v1/chat/completions")


def test_round_robin_cycles_over_healthy_replicas_only():
    policy = build_policy("round_robin")
    s = snap(ReplicaView("a"), ReplicaView("b", healthy=False), ReplicaView("c"))
    picks = [policy.decide(s, REQ, random.Random(0)).replica for _ in range(4)]
    assert picks == ["a", "c", "a", "c"]


def test_excluded_replicas_are_skipped_and_none_when_nothing_left():
    policy = build_policy("round_robin")
    s = snap(ReplicaView("a"), ReplicaView("b"))
    req = RequestSummary(route="/generate", exclude=frozenset({"a"}))
    assert policy.decide(s, req, random.Random(0)).replica == "b"
    req_all = RequestSummary(route="/generate", exclude=frozenset({"a", "b"}))
    assert policy.decide(s, req_all, random.Random(0)) is None


def test_random_is_reproducible_with_a_seeded_rng_and_covers_all():
    policy = build_policy("random")
    s = snap(*(ReplicaView(str(i)) for i in range(4)))
    first = [policy.decide(s, REQ, random.Random(7)).replica for _ in range(3)]
    again = [policy.decide(s, REQ, random.Random(7)).replica for _ in range(3)]
    assert first == again
    rng = random.Random(1)
    seen = {policy.decide(s, REQ, rng).replica for _ in range(200)}
    assert seen == {"0", "1", "2", "3"}
    assert policy.decide(snap(ReplicaView("x", healthy=False)), REQ, rng) is None


def test_unknown_policy_name_is_rejected():
    with pytest.raises(ValueError, match="unknown policy"):
        build_policy("nope")
