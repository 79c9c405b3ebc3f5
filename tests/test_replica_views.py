"""The registry replaces a replica's frozen view on every change; the new view must be exactly
the old one with the changed fields, and the fleet aggregates must follow."""

from __future__ import annotations

import dataclasses

from kvrouter.policies.domain import ReplicaView
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.sglang_protocol.signals import ReplicaSignals

A, B = "http://a:1", "http://b:1"


def test_each_change_keeps_every_other_field():
    registry = ReplicaRegistry([A, B], failure_threshold=1)
    expected = registry.view(A)
    registry.dispatched(A, 700)
    expected = dataclasses.replace(expected, in_flight=1, in_flight_prompt_tokens=700)
    assert registry.view(A) == expected
    registry.update_signals(A, ReplicaSignals(num_running_reqs=4, num_queue_reqs=2, token_usage=0.5,
                                              num_used_tokens=9, max_total_num_tokens=18,
                                              cache_hit_rate=0.25))
    expected = dataclasses.replace(expected, num_running_reqs=4, num_queue_reqs=2, token_usage=0.5,
                                   num_used_tokens=9, max_total_num_tokens=18, cache_hit_rate=0.25)
    assert registry.view(A) == expected
    registry.set_homed(A, 3, 1200)
    expected = dataclasses.replace(expected, homed_sessions=3, homed_tokens=1200)
    assert registry.view(A) == expected
    registry.completed(A, 700)
    expected = dataclasses.replace(expected, in_flight=0, in_flight_prompt_tokens=0)
    assert registry.view(A) == expected
    assert registry.record_failure(A)
    expected = dataclasses.replace(expected, healthy=False)
    assert registry.view(A) == expected and type(registry.view(A)) is ReplicaView
    assert registry.view(B) == ReplicaView(id=B)
    snapshot = registry.snapshot()
    assert snapshot.healthy_count == 1 and snapshot.healthy_load == 0
    assert snapshot.replicas == (expected, ReplicaView(id=B))
