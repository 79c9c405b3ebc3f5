"""The registry replaces a replica's frozen view on every change; the new view must be exactly
the old one with the changed fields, and the fleet aggregates must follow."""

from __future__ import annotations

import dataclasses

from kvrouter.policies.domain import LoadScan, ReplicaView, RequestSummary
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


def test_a_request_that_ends_before_the_next_read_leaves_the_view_and_snapshot():
    registry = ReplicaRegistry([A, B])
    before = registry.snapshot()
    registry.dispatched(A, 300)
    registry.completed(A, 300)
    assert registry.snapshot() is before  # nothing to rebuild
    registry.dispatched(A, 300)
    registry.dispatched(B, 50)
    registry.completed(A, 300)
    registry.dispatched(A, 20)
    after = registry.snapshot()
    assert after is not before
    assert (after.get(A).in_flight, after.get(A).in_flight_prompt_tokens) == (1, 20)
    assert (after.get(B).in_flight, after.get(B).in_flight_prompt_tokens) == (1, 50)
    assert after.healthy_load == 2 and after.loads == (1, 1)
    # every other way in sees the counts too: a view read, another change, a completion
    registry.completed(A, 20)
    assert registry.view(A).in_flight == 0 and registry.view(A).load == 0
    registry.dispatched(B, 5)
    registry.set_homed(B, 1, 10)
    assert registry.view(B).in_flight == 2 and registry.view(B).homed_sessions == 1
    registry.completed(B, 500)  # never below zero
    registry.completed(B, 500)
    registry.completed(B, 500)
    assert (registry.view(B).in_flight, registry.view(B).in_flight_prompt_tokens) == (0, 0)
    registry.dispatched(A, 1)
    registry.remove(A)
    assert registry.view(A) is None and [v.id for v in registry.snapshot().replicas] == [B]


def test_a_session_home_changed_meanwhile_is_applied_with_the_in_flight_counts_on_the_next_read():
    """A keyed turn changes its home's homed tokens at claim and at release, around its
    dispatch and completion: the view and snapshot are rebuilt once, when next read, with all
    of it; a change undone before that rebuilds nothing."""
    registry = ReplicaRegistry([A, B])
    before = registry.snapshot()
    registry.set_homed(A, 1, 500)
    registry.dispatched(A, 500)
    registry.set_homed(A, 0, 0)
    registry.completed(A, 500)
    assert registry.snapshot() is before  # all undone: nothing to rebuild
    view = registry.view(A)
    registry.set_homed(A, 1, 500)
    registry.dispatched(A, 500)
    registry.completed(A, 500)
    registry.set_homed(A, 1, 900)
    assert registry._views[A] is view  # noted, not yet rebuilt
    after = registry.snapshot()
    assert after is not before and after.get(A) == dataclasses.replace(view, homed_sessions=1, homed_tokens=900)
    assert after.get(A).in_flight == 0 and after.loads == (0, 0)
    # every other way in sees them too: a view read, another change, a removal
    registry.set_homed(B, 2, 40)
    assert registry.view(B).homed_sessions == 2 and registry.view(B).homed_tokens == 40
    registry.set_homed(B, 3, 50)
    registry.record_success(B)
    registry.mark_settled(B)
    registry.set_peer_in_flight(B, 2)
    assert (registry.view(B).homed_sessions, registry.view(B).peer_in_flight) == (3, 2)
    registry.set_homed(A, 4, 4)
    registry.remove(A)
    assert registry.view(A) is None and [v.id for v in registry.snapshot().replicas] == [B]


def _slots(obj: object) -> dict[str, object]:
    """Every field, the ones equality skips (load, cost_terms, memo) too."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}  # type: ignore[arg-type]


def test_views_and_snapshots_the_registry_makes_match_their_constructors_in_every_field():
    registry = ReplicaRegistry([A])
    registry.add(B)  # fresh
    registry.update_signals(B, ReplicaSignals(num_running_reqs=1, num_queue_reqs=5, token_usage=0.5))
    registry.dispatched(B, 300, 40)
    registry.dispatched(A, 100)
    snapshot = registry.snapshot()
    view = registry.view(B)
    built = ReplicaView(id=B, fresh=True, in_flight=1, in_flight_prompt_tokens=300,
                        num_running_reqs=1, num_queue_reqs=5, token_usage=0.5, pending_prefill_tokens=40)
    assert _slots(view) == _slots(built) and view.load == 6 and view.cost_terms is None
    fields = _slots(snapshot)
    memo = fields.pop("memo")
    assert type(memo).__name__ == "FleetMemo" and memo.candidates == {} and memo.loads == {}
    assert fields == {"replicas": (registry.view(A), view), "session": None, "by_id": snapshot.by_id,
                      "healthy_load": 7, "healthy_count": 2, "fresh": (B,), "epoch": snapshot.epoch,
                      "loads": (1, 6), "fleet_loads": registry}
    assert snapshot.load_scan(RequestSummary("/x")) == LoadScan(1, 6, (registry.view(A),))
    assert registry.snapshot() is snapshot  # nothing changed since


def test_views_and_snapshots_made_without_their_constructors_equal_constructed_ones() -> None:
    """The registry fills views and snapshots through a same-layout twin class, then gives them
    their class: equal to what the constructors make, of exactly that class, and still frozen."""
    import dataclasses

    import pytest

    from kvrouter.policies.domain import FleetMemo, ReplicaView, Snapshot
    from kvrouter.router.replicas import _new_snapshot, _new_view, _view_values

    made = ReplicaView(id="r", healthy=True, fresh=False, in_flight=3, num_running_reqs=5,
                       num_queue_reqs=2, peer_in_flight=1, homed_tokens=7)
    view = _new_view(list(_view_values(made)))
    assert type(view) is ReplicaView and view == made and hash(view) == hash(made)
    assert (view.load, view.cost_terms) == (made.load, made.cost_terms) == (7, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.in_flight = 4  # type: ignore[misc]
    values = ((view,), None, None, 7, 1, (), 3, (7,), None, FleetMemo())
    snapshot = _new_snapshot(values)
    assert type(snapshot) is Snapshot and snapshot == Snapshot(*values)
    assert [getattr(snapshot, f.name) for f in dataclasses.fields(Snapshot)] == list(values)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.epoch = 4  # type: ignore[misc]
