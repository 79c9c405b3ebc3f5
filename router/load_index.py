"""The healthy replicas grouped by load, kept by the registry as views change, so that the fleet's
load scan (least and most load, the least-loaded replicas in snapshot order: `policies.domain.
LoadScan`) costs a change's work, not a pass over the fleet, on every snapshot.

Loads are small integers that mostly move by one (a dispatch, a completion) and now and then jump
(a polled signal, a health change, a replica added or removed): each distinct load holds its
replicas ordered by registration number, which is the order of the registry's views and so of a
snapshot's `replicas`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping

from ..policies.domain import LoadScan, ReplicaView

_NO_REPLICAS = LoadScan(0, 0, ())


class LoadIndex:
    """Healthy views by load. `order` maps each member's id to its registration number (views are
    kept in that order); a view must be inserted before, and discarded before, its id leaves it."""

    __slots__ = ("_order", "_at", "_scan")

    def __init__(self, order: Mapping[str, int]) -> None:
        self._order = order
        # load -> (registration numbers ascending, the views in the same order)
        self._at: dict[int, tuple[list[int], list[ReplicaView]]] = {}
        self._scan: LoadScan | None = _NO_REPLICAS

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
        """`discard(old)` then `insert(new)`, for a view of the same replica."""
        load = old.load
        if new.load != load:
            self.discard(old)
            self.insert(new)
            return
        numbers, views = self._at[load]
        views[bisect_left(numbers, self._order[old.id])] = new
        scan = self._scan
        if scan is not None and load == scan.low:  # one of the least-loaded views changed
            self._scan = None

    def scan(self) -> LoadScan:
        """What `Snapshot.load_scan` finds over every healthy replica (no exclusions)."""
        scan = self._scan
        if scan is None:
            at = self._at
            if at:
                low = min(at)
                scan = LoadScan(low, max(at), tuple(at[low][1]))
            else:
                scan = _NO_REPLICAS
            self._scan = scan
        return scan
