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
    assert registry.view(A) == expected and registry.view(A).load == 1  # derived fields follow
    registry.update_signals(A, ReplicaSignals(num_running_reqs=4, num_queue_reqs=2, token_usage=0.5,
                                              num_used_tokens=9, max_total_num_tokens=18,
                                              cache_hit_rate=0.25))
    expected = dataclasses.replace(expected, num_running_reqs=4, num_queue_reqs=2, token_usage=0.5,
                                   num_used_tokens=9, max_total_num_tokens=18, cache_hit_rate=0.25)
    assert registry.view(A) == expected and registry.view(A).load == 6
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


def test_a_poll_that_repeats_the_gauges_keeps_the_view_and_snapshot():
    registry = ReplicaRegistry([A, B])
    signals = ReplicaSignals(num_running_reqs=2, num_queue_reqs=0, token_usage=0.0,
                             num_used_tokens=0, max_total_num_tokens=100, cache_hit_rate=0.5)
    registry.update_signals(A, signals)
    view, snapshot = registry.view(A), registry.snapshot()
    registry.update_signals(A, dataclasses.replace(signals))
    assert registry.view(A) is view and registry.snapshot() is snapshot
    registry.update_signals(A, dataclasses.replace(signals, token_usage=0))  # 0, not 0.0
    assert type(registry.view(A).token_usage) is int and registry.snapshot() is not snapshot
    registry.update_signals(A, None)  # stale: unknown again
    assert registry.view(A).num_running_reqs is None and registry.view(A).load == 0
