"""The healthy replicas grouped by load, kept by the registry as views change, so that the fleet's
load scan (least and most load, the least-loaded replicas in snapshot order: `policies.domain.
LoadScan`) costs a change's work, not a pass over the fleet, on every snapshot.

Loads are small integers that mostly move by one (a dispatch, a completion) and now and then jump
(a polled signal, a health change, a replica added or removed): each distinct load holds its
replicas ordered by registration number, which is the order of the registry's views and so of a
snapshot's `replicas`. The index is built on the first scan asked for and kept from then on: a
router whose policies never scan loads pays nothing for it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping

from ..policies.domain import LoadScan, ReplicaView

_NO_REPLICAS = LoadScan(0, 0, ())


class LoadIndex:
    """Healthy views by load, once `active`. `order` maps each member's id to its registration
    number, `views` each id to its view (in that order); while active, a view must be inserted
    before, and discarded before, its id leaves `order`."""

    __slots__ = ("_order", "_views", "_at", "_scan", "active")

    def __init__(self, order: Mapping[str, int], views: Mapping[str, ReplicaView]) -> None:
        self._order = order
        self._views = views
        # load -> (registration numbers ascending, the views in the same order)
        self._at: dict[int, tuple[list[int], list[ReplicaView]]] = {}
        self._scan: LoadScan | None = None
        self.active = False  # kept up to date by the registry from the first scan on

    def _activate(self) -> None:
        order, at_load = self._order, self._at
        for view in self._views.values():  # already in registration order
            if view.healthy:
                bucket = at_load.get(view.load)
                if bucket is None:
                    at_load[view.load] = ([order[view.id]], [view])
                else:
                    bucket[0].append(order[view.id])
                    bucket[1].append(view)
        self.active = True

    def _changes_scan(self, load: int) -> None:
        """Forget the kept scan unless `load` lies strictly between its least and most load (a
        change there leaves least, most and the least-loaded replicas as they are)."""
        scan = self._scan
        if scan is not None and not scan.low < load < scan.high:
            self._scan = None

    def insert(self, view: ReplicaView) -> None:
        load, number = view.load, self._order[view.id]
        bucket = self._at.get(load)
        if bucket is None:
            self._at[load] = ([number], [view])
        else:
            numbers, views = bucket
            at = bisect_left(numbers, number)
            numbers.insert(at, number)
            views.insert(at, view)
        self._changes_scan(load)

    def discard(self, view: ReplicaView) -> None:
        load = view.load
        numbers, views = self._at[load]
        at = bisect_left(numbers, self._order[view.id])
        if len(numbers) == 1:
            del self._at[load]
        else:
            del numbers[at], views[at]
        self._changes_scan(load)

    def replace(self, old: ReplicaView, new: ReplicaView) -> None:
        """`discard(old)` then `insert(new)`, for a view of the same replica: written out in one
        call, as it runs on every dispatch and completion."""
        load, number, at_load = old.load, self._order[old.id], self._at
        numbers, views = at_load[load]
        at = bisect_left(numbers, number)
        scan = self._scan
        new_load = new.load
        if new_load == load:
            views[at] = new
            if scan is not None and load == scan.low:  # one of the least-loaded views changed
                self._scan = None
            return
        if len(numbers) == 1:
            del at_load[load]
        else:
            del numbers[at], views[at]
        bucket = at_load.get(new_load)
        if bucket is None:
            at_load[new_load] = ([number], [new])
        else:
            numbers, views = bucket
            at = bisect_left(numbers, number)
            numbers.insert(at, number)
            views.insert(at, new)
        if scan is not None and not (scan.low < load < scan.high and scan.low < new_load < scan.high):
            self._scan = None

    def scan(self) -> LoadScan:
        """What `Snapshot.load_scan` finds over every healthy view (no exclusions)."""
        scan = self._scan
        if scan is None:
            if not self.active:
                self._activate()
            at = self._at
            if at:
                low = min(at)
                scan = LoadScan(low, max(at), tuple(at[low][1]))
            else:
                scan = _NO_REPLICAS
            self._scan = scan
        return scan
