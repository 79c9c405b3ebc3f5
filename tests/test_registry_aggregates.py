"""The fleet aggregates the registry keeps incrementally (healthy load and count, fresh replicas,
each view's load, the id index, the load scan) and hands to policies in every snapshot, so that
`fresh_below_mean`, `mean_load`, sampling and the load-based policies never scan the fleet: after
any sequence of dispatches, completions, polls, homes, peer counts, health changes, drains,
additions and removals they equal what a scan of the snapshot's views finds."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.policies.domain import LoadScan, RequestSummary, SessionView, Snapshot
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.sglang_protocol.signals import ReplicaSignals

URLS = [f"http://r{i}:1" for i in range(5)]

signals = st.one_of(st.none(), st.builds(
    ReplicaSignals, num_running_reqs=st.integers(0, 50), num_queue_reqs=st.one_of(st.none(), st.integers(0, 5)),
    token_usage=st.floats(0, 1), max_total_num_tokens=st.sampled_from([None, 1000, 500_000])))

url = st.sampled_from(URLS)
ops = st.one_of(
    st.tuples(st.just("add"), url, st.booleans()),
    st.tuples(st.just("remove"), url),
    st.tuples(st.just("dispatched"), url, st.integers(0, 9_000), st.integers(0, 9_000)),
    st.tuples(st.just("completed"), url, st.integers(0, 9_000), st.integers(0, 9_000)),
    st.tuples(st.just("prefill_answered"), url, st.integers(0, 9_000)),
    st.tuples(st.just("update_signals"), url, signals),
    st.tuples(st.just("set_homed"), url, st.integers(0, 4), st.integers(0, 400_000)),
    st.tuples(st.just("set_peer_in_flight"), url, st.integers(0, 6)),
    st.tuples(st.just("record_failure"), url),
    st.tuples(st.just("record_success"), url),
    st.tuples(st.just("drain"), url),
    st.tuples(st.just("mark_settled"), url),
)


def check(registry: ReplicaRegistry) -> None:
    snapshot = registry.snapshot()
    views = snapshot.replicas
    healthy = [v for v in views if v.healthy]
    assert snapshot.healthy_count == len(healthy)
    assert snapshot.healthy_load == sum(v.load for v in healthy)
    assert sorted(snapshot.fresh) == sorted(v.id for v in views if v.fresh)
    assert len(set(snapshot.fresh)) == len(snapshot.fresh)
    assert snapshot.loads == tuple(v.load for v in views)
    assert dict(snapshot.by_id) == {v.id: v for v in views}
    mean = sum(v.load for v in healthy) / len(healthy) if healthy else 0.0
    assert snapshot.mean_load() == mean
    # The kept load scan is what a scan of the views finds (a hand-built snapshot computes it),
    # its least-loaded views the snapshot's own objects, in snapshot order.
    kept = snapshot.fleet_loads.scan_for(snapshot)
    scanned = Snapshot(views).load_scan(RequestSummary("/x"))
    assert kept is not None and (kept.low, kept.high) == (scanned.low, scanned.high)
    assert [id(v) for v in kept.least] == [id(v) for v in scanned.least]
    assert snapshot.load_scan(RequestSummary("/x")) is kept


@settings(max_examples=150, deadline=None)
@given(st.lists(ops, max_size=40), st.booleans())
def test_kept_aggregates_equal_a_scan_of_the_views(sequence, read_between: bool) -> None:
    registry = ReplicaRegistry(URLS[:2], failure_threshold=2)
    for op, target, *args in sequence:
        if op == "add":
            registry.add(target, fresh=args[0])
        else:
            getattr(registry, op)(target, *args)
        if read_between:  # in-flight counts reach the views when read: check both orders
            check(registry)
    check(registry)


def test_the_kept_scan_hands_out_a_least_loaded_view_changed_at_the_same_load() -> None:
    registry = ReplicaRegistry(URLS[:3])
    registry.update_signals(URLS[0], ReplicaSignals(num_running_reqs=4))
    registry.dispatched(URLS[1], 10, 5)
    registry.dispatched(URLS[2], 10, 5)
    check(registry)  # least load 1 (r1, r2), most 4 (r0)
    registry.prefill_answered(URLS[1], 5)  # a new view of r1, still at load 1
    registry.dispatched(URLS[0], 10)  # a new view of r0, still at load 4 (its polled count)
    check(registry)
    registry.completed(URLS[2], 10, 5)  # r2 alone is least loaded now
    registry.record_failure(URLS[2])
    registry.record_failure(URLS[2])
    registry.record_failure(URLS[2])  # unhealthy: not a candidate
    check(registry)
    assert [v.id for v in registry.snapshot().load_scan(RequestSummary("/x")).least] == [URLS[1]]


def test_a_snapshot_older_than_the_registry_scans_its_own_views() -> None:
    registry = ReplicaRegistry(URLS[:3])
    registry.dispatched(URLS[0], 10)
    older = registry.snapshot()
    registry.dispatched(URLS[1], 10)
    registry.snapshot()  # the registry's replicas change after `older` was taken
    assert older.fleet_loads.scan_for(older) is None
    assert [v.id for v in older.load_scan(RequestSummary("/x")).least] == [URLS[1], URLS[2]]
    assert [v.id for v in registry.snapshot().load_scan(RequestSummary("/x")).least] == [URLS[2]]


def same_scan(got: LoadScan, want: LoadScan) -> bool:
    """Equal scans whose least-loaded views are the very same objects, in the same order."""
    return (got.low, got.high) == (want.low, want.high) and \
        [id(v) for v in got.least] == [id(v) for v in want.least]


def drive(rng: random.Random, steps: int) -> None:
    """Random changes to a small registry, interleaved with snapshots taken and read at once (as
    a decision reads its own), kept and read again later (as deferred decision notes read theirs
    after the dispatch), as a session's copy, with a retry's exclusions, and a policy filling in
    a view's cost terms: each read must be a scan of the views that snapshot holds."""
    urls = URLS[:rng.randint(1, len(URLS))]
    registry = ReplicaRegistry(urls[:rng.randint(0, len(urls))], failure_threshold=rng.randint(1, 3))
    kept: list[Snapshot] = []

    def read(snapshot: Snapshot, exclude: frozenset[str] = frozenset()) -> None:
        request = RequestSummary("/x", exclude=exclude)
        assert same_scan(snapshot.load_scan(request), Snapshot(snapshot.replicas).load_scan(request))

    for _ in range(steps):
        u, n = rng.choice(urls), rng.randint(0, 40)
        change = rng.randrange(15)
        if change == 0:
            registry.add(u, fresh=rng.random() < 0.5)
        elif change == 1:
            registry.remove(u)  # (added back later: a new registration of the same id)
        elif change in (2, 3):
            registry.dispatched(u, n, rng.randint(0, 40))
        elif change in (4, 5):
            registry.completed(u, n, rng.randint(0, 40))
        elif change == 6:
            registry.prefill_answered(u, n)  # a new view at the same load
        elif change == 7:  # a poll, or signals gone stale
            registry.update_signals(u, None if rng.random() < 0.3 else ReplicaSignals(
                num_running_reqs=rng.randint(0, 6), num_queue_reqs=rng.choice([None, 0, 2])))
        elif change == 8:
            registry.set_homed(u, rng.randint(0, 3), n)
        elif change == 9:
            registry.set_peer_in_flight(u, rng.randint(0, 3))
        elif change == 10:
            registry.record_failure(u)
        elif change == 11:
            registry.record_success(u)
        elif change == 12:
            registry.drain(u)
        elif change == 13:
            registry.mark_settled(u)
        elif (view := registry.view(u)) is not None:  # kept with the view: not a change of it
            object.__setattr__(view, "cost_terms", ("terms",))
        if rng.random() < 0.4:
            snapshot = registry.snapshot()
            if rng.random() < 0.3:
                snapshot = snapshot.with_session(SessionView("s", rng.choice(urls)))
            read(snapshot)
            kept = [*kept[-4:], snapshot]
        if kept and rng.random() < 0.5:
            read(rng.choice(kept), frozenset(rng.sample(urls, rng.randint(0, 1))))


def test_any_snapshot_scans_its_own_views_however_old() -> None:
    """The kept scan serves a snapshot only while it holds the registry's current views; an older
    one, a session's copy or a retry's request gets a scan of that snapshot's own views."""
    for seed in range(60):
        drive(random.Random(seed), 300)
