"""Live replica state owned by the control loop, and the immutable snapshots policies read.

Every change replaces that replica's frozen `ReplicaView`; a snapshot is the tuple of current
views, rebuilt only after a change, so taking one per request is cheap even at 1000 replicas.
In-flight counts (changed twice per request: dispatch and completion) reach a replica's view
when it is next read (`snapshot`, `view`, any other change): a request that ended before the
next decision leaves the view, and the snapshot, as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from operator import attrgetter
from types import MappingProxyType
from typing import Any

from ..sglang_protocol.signals import ReplicaSignals
from ..policies.domain import FleetMemo, LoadScan, ReplicaView, Snapshot
from .load_index import LoadIndex
from ..policies.slots import slot_filler

_SIGNAL_FIELDS = (
    "num_running_reqs", "num_queue_reqs", "token_usage", "num_used_tokens",
    "max_total_num_tokens", "cache_hit_rate", "rank_kv",
)

# ReplicaView's constructor fields in order: `_replaced` rebuilds a view positionally, as
# dataclasses.replace would by keyword, at a fraction of its cost (a view is replaced on every
# dispatch, completion and poll; the cluster simulator does that hundreds of thousands of times).
# Derived fields (init=False) are not passed: the view's __post_init__ computes them again.
_VIEW_FIELDS = tuple(f.name for f in dataclasses.fields(ReplicaView) if f.init)
_VIEW_INDEX = {name: i for i, name in enumerate(_VIEW_FIELDS)}
_view_values = attrgetter(*_VIEW_FIELDS)
_IN_FLIGHT_INDEX = tuple(_VIEW_INDEX[name] for name in
                         ("in_flight", "in_flight_prompt_tokens", "pending_prefill_tokens"))
_HOMED_INDEX = tuple(_VIEW_INDEX[name] for name in ("homed_sessions", "homed_tokens"))

# A new view, and a new snapshot, are made once per decision at any concurrency (each sees the
# in-flight counts the last one changed): filled without their frozen __init__ (policies/slots.py).
# `_new_view(values)` is `ReplicaView(*values)` (its __post_init__ run by the filler), and
# `_new_snapshot(values)` is `Snapshot(*values)` with every field given (its memo a new FleetMemo).
_new_view = slot_filler(ReplicaView, _VIEW_FIELDS, tuple(  # (__post_init__ sets the rest)
    (f.name, f.default) for f in dataclasses.fields(ReplicaView)
    if not f.init and f.default is not dataclasses.MISSING))
_new_snapshot = slot_filler(Snapshot, tuple(f.name for f in dataclasses.fields(Snapshot)))


def _same(a: object, b: object) -> bool:
    """Equal and of one type (0 and 0.0, or False and 0, are different gauge values)."""
    return type(a) is type(b) and a == b


def _replaced(view: ReplicaView, changes: dict[str, Any]) -> ReplicaView:
    """`dataclasses.replace(view, **changes)`, faster."""
    values = list(_view_values(view))
    for name, value in changes.items():
        values[_VIEW_INDEX[name]] = value
    return _new_view(values)


class ReplicaRegistry:
    def __init__(self, urls: Iterable[str] = (), failure_threshold: int = 3) -> None:
        self.failure_threshold = failure_threshold
        self._views: dict[str, ReplicaView] = {}
        self._by_id = MappingProxyType(self._views)
        self._failures: dict[str, int] = {}
        self._snapshot: Snapshot | None = None
        # In-flight (requests, prompt tokens, pending prefill tokens) of replicas whose view does not
        # carry them yet.
        self._in_flight: dict[str, tuple[int, int, int]] = {}
        # Homed sessions and tokens likewise (a session's tokens grow each turn: every keyed
        # request changes its home's), noted until the view is next read.
        self._homed: dict[str, tuple[int, int]] = {}
        # Fleet aggregates kept up to date on every change, so snapshots need no scan.
        self._healthy_load = 0
        self._healthy_count = 0
        self._fresh: dict[str, None] = {}
        self._loads: dict[str, int] = {}  # each view's load, in view order (load-scanning policies)
        self._epoch = 0
        # Which registration of a URL is current: a slot reserved on an earlier one (the replica
        # was removed and added back meanwhile) must not be released on the new one. Numbers
        # grow, so they also sort the views in their order (what the load index keeps).
        self._registrations: dict[str, int] = {}
        self._registered = 0
        self._by_load = LoadIndex(self._registrations, self._views)  # healthy views by load
        self.draining: set[str] = set()  # no new work; removed once their in-flight ends
        # Told each time this router's in-flight count on a replica changes (router/peer_share.py
        # publishes the counts to the other routers); None: nobody to tell.
        self.on_in_flight: Callable[[], None] | None = None
        for url in urls:
            self.add(url, fresh=False)

    # -- membership -------------------------------------------------------------------------
    def add(self, url: str, *, fresh: bool = True) -> bool:
        if url in self._views:
            return False
        view = ReplicaView(id=url, fresh=fresh)
        self._views[url] = view
        self._loads[url] = view.load
        self._registered += 1
        self._registrations[url] = self._registered
        self._account(view, 1)
        self._failures[url] = 0
        self._epoch += 1
        self._snapshot = None
        return True

    def registration(self, url: str) -> int | None:
        """A number that changes each time `url` is added; None while it is not a member."""
        return self._registrations.get(url)

    def remove(self, url: str) -> bool:
        view = self._views.pop(url, None)
        if view is None:
            return False
        self._in_flight.pop(url, None)
        self._homed.pop(url, None)
        del self._loads[url]
        self._account(view, -1)
        self._failures.pop(url, None)
        self._registrations.pop(url, None)
        self.draining.discard(url)
        self._epoch += 1
        self._snapshot = None
        return True

    def _account(self, view: ReplicaView, sign: int) -> None:
        if view.healthy:
            self._healthy_load += sign * view.load
            self._healthy_count += sign
            if self._by_load.active:
                if sign > 0:
                    self._by_load.insert(view)
                else:
                    self._by_load.discard(view)
        if view.fresh:
            if sign > 0:
                self._fresh[view.id] = None
            else:
                self._fresh.pop(view.id, None)

    def urls(self) -> list[str]:
        return list(self._views)

    def view(self, url: str) -> ReplicaView | None:
        if url in self._in_flight or url in self._homed:
            self._apply_noted(url)
        return self._views.get(url)

    def healthy(self, url: str) -> bool:
        """Known and healthy: a replica a request may go to."""
        view = self._views.get(url)
        return view is not None and view.healthy

    def __contains__(self, url: object) -> bool:
        return url in self._views

    def __len__(self) -> int:
        return len(self._views)

    # -- snapshots --------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The current views. `by_id` is a read-only window on the live table: consistent with
        `replicas` for as long as a synchronous policy call lasts, which is all a policy gets."""
        if self._in_flight or self._homed:
            for url in {**self._in_flight, **self._homed}:  # each once: it applies both notes
                self._apply_noted(url)
        if self._snapshot is None:
            self._snapshot = _new_snapshot((
                tuple(self._views.values()), None, self._by_id, self._healthy_load,
                self._healthy_count, tuple(self._fresh), self._epoch, tuple(self._loads.values()),
                self, FleetMemo(),
            ))
        return self._snapshot

    def _update(self, url: str, **changes: Any) -> ReplicaView | None:
        if url in self._in_flight or url in self._homed:
            self._apply_noted(url)
        view = self._views.get(url)
        if view is None:
            return None
        self._account(view, -1)
        view = _replaced(view, changes)
        self._account(view, 1)
        self._install(url, view)
        return view

    def _install(self, url: str, view: ReplicaView) -> None:
        """`view` is `url`'s current one (its totals already accounted): snapshots start anew."""
        self._views[url] = view
        self._loads[url] = view.load
        self._snapshot = None

    def scan_for(self, snapshot: Snapshot) -> LoadScan | None:
        """The load scan of every healthy replica, kept as views change (`policies.domain.
        FleetLoads`), if `snapshot` still holds the current views; else None."""
        current = self._snapshot
        if current is None or current.replicas is not snapshot.replicas:
            return None
        return self._by_load.scan()

    # -- polled signals and session totals -----------------------------------------------------
    def update_signals(self, url: str, signals: ReplicaSignals | None) -> None:
        """New polled signals, or None when they went stale (unknown)."""
        view = self._views.get(url)
        if view is None:
            return
        values = {f: (getattr(signals, f) if signals is not None else None) for f in _SIGNAL_FIELDS}
        # Most polls repeat the last gauges (SGLang refreshes them only every few dozen steps):
        # keep the view, and the cached snapshot, when nothing would change.
        if all(_same(getattr(view, f), v) for f, v in values.items()):
            return
        self._update(url, **values)

    def set_homed(self, url: str, sessions: int, tokens: int) -> None:
        """Note `url`'s homed sessions and tokens; its view (and the snapshot) change when next
        read, once for this and the in-flight counts noted meanwhile."""
        view = self._views.get(url)
        if view is None:
            return
        if (sessions, tokens) == (view.homed_sessions, view.homed_tokens):
            self._homed.pop(url, None)  # back to what the view says: nothing to rebuild
        else:
            self._homed[url] = (sessions, tokens)

    def mark_settled(self, url: str) -> None:
        """A fresh replica has caught up with the cluster: no longer preferred."""
        view = self._views.get(url)
        if view is not None and view.fresh:
            self._update(url, fresh=False)

    # -- in-flight accounting (dispatch and completion) -------------------------------------
    def dispatched(self, url: str, prompt_tokens: int, prefill_tokens: int = 0) -> None:
        """A request was sent to `url`; `prefill_tokens` of its prompt are not cached there (they
        stay pending until `prefill_answered`, or until `completed` if it ends before)."""
        view = self._views.get(url)
        if view is not None:
            requests, tokens, pending = self._counts(url, view)
            self._set_in_flight(url, view, requests + 1, tokens + prompt_tokens, pending + prefill_tokens)
            if self.on_in_flight is not None:
                self.on_in_flight()

    def completed(self, url: str, prompt_tokens: int, prefill_tokens: int = 0) -> None:
        """A request on `url` ended; `prefill_tokens`: its pending prefill, if it never answered."""
        view = self._views.get(url)
        if view is not None:
            requests, tokens, pending = self._counts(url, view)
            self._set_in_flight(
                url, view, max(0, requests - 1), max(0, tokens - prompt_tokens), max(0, pending - prefill_tokens)
            )
            if self.on_in_flight is not None:
                self.on_in_flight()

    def prefill_answered(self, url: str, prefill_tokens: int) -> None:
        """A request on `url` sent its first byte: its prefill is done, no longer work ahead."""
        view = self._views.get(url)
        if view is not None and prefill_tokens:
            requests, tokens, pending = self._counts(url, view)
            self._set_in_flight(url, view, requests, tokens, max(0, pending - prefill_tokens))

    def _counts(self, url: str, view: ReplicaView) -> tuple[int, int, int]:
        """`url`'s in-flight requests, prompt tokens and pending prefill, noted or in its view."""
        return self._in_flight.get(url) or (view.in_flight, view.in_flight_prompt_tokens, view.pending_prefill_tokens)

    def _set_in_flight(self, url: str, view: ReplicaView, requests: int, tokens: int, pending: int) -> None:
        """Note `url`'s in-flight counts; its view (and the snapshot) change when next read."""
        if (requests, tokens, pending) == (view.in_flight, view.in_flight_prompt_tokens, view.pending_prefill_tokens):
            self._in_flight.pop(url, None)  # back to what the view says: nothing to rebuild
        else:
            self._in_flight[url] = (requests, tokens, pending)

    def _apply_noted(self, url: str) -> None:
        """`_update(url, in_flight=..., in_flight_prompt_tokens=..., pending_prefill_tokens=...,
        homed_sessions=..., homed_tokens=...)` for the noted counts: only the view's load changes
        of what `_account` adds up (and the view itself, in the load index)."""
        counts = self._in_flight.pop(url, None)
        homed = self._homed.pop(url, None)
        view = self._views.get(url)
        if view is None:
            return
        values = list(_view_values(view))
        if counts is not None:
            for index, count in zip(_IN_FLIGHT_INDEX, counts):
                values[index] = count
        if homed is not None:
            for index, count in zip(_HOMED_INDEX, homed):
                values[index] = count
        new = _new_view(values)
        if new.healthy:
            self._healthy_load += new.load - view.load
            if self._by_load.active:
                self._by_load.replace(view, new)
        if new.fresh:  # last in the fresh order, as `_account` leaves a replaced view
            del self._fresh[url]
            self._fresh[url] = None
        self._install(url, new)

    def set_peer_in_flight(self, url: str, requests: int) -> None:
        """The other routers' requests in flight on `url` (router/peer_share.py): counted in the
        view's load, not in its own `in_flight` (which drains and shutdown wait on)."""
        view = self._views.get(url)
        if view is not None and view.peer_in_flight != requests:
            self._update(url, peer_in_flight=requests)

    # -- health -----------------------------------------------------------------------------
    def drain(self, url: str) -> bool:
        """Take no new work on `url` (it looks unhealthy to policies); in-flight requests go on."""
        if url not in self._views:
            return False
        self.draining.add(url)
        if self._views[url].healthy:
            self._update(url, healthy=False)
        return True

    def record_success(self, url: str) -> bool:
        """A probe or request reached the replica. Returns True if it just became healthy."""
        if url not in self._views or url in self.draining:
            return False
        self._failures[url] = 0
        if not self._views[url].healthy:
            self._update(url, healthy=True)
            return True
        return False

    def record_failure(self, url: str) -> bool:
        """A probe or connect failed. Returns True if this failure made it unhealthy."""
        if url not in self._views:
            return False
        self._failures[url] += 1
        if self._views[url].healthy and self._failures[url] >= self.failure_threshold:
            self._update(url, healthy=False)
            return True
        return False
