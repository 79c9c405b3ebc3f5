"""LRU eviction of the run-compressed radix cache (radix_cache.RadixCache): device leaves to host
or out, host leaves out, in exactly the order a per-page LRU takes them.

The heaps hold (time, last page key, run) for leaf runs; an entry is stale once its run changed
(lazy invalidation). A leaf run's pages leave last page first, all at the run's time, so a batch of
them goes at once while each (time, key) still sorts before the heap's next entry: a per-page heap
would pop them in that same order. Every page still gets its own KV event.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .radix_cache import KVSink, StoredPage, _Run

DEVICE = 0
HOST = 1
GONE = -1  # a run no longer in the tree (its heap entries are stale)
# StorageMedium values in python/sglang/srt/disaggregation/kv_events.py
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU_PINNED"


class EvictionMixin:
    page_size: int
    write_through: bool
    host_capacity_pages: int
    sink: KVSink | None
    dev_pages: int
    host_pages: int
    evicted_pages_total: int
    _runs: int
    _dev_heap: list[tuple[float, int, _Run]]
    _host_heap: list[tuple[float, int, _Run]]

    if TYPE_CHECKING:
        def _split(self, run: _Run, j: int) -> _Run: ...
        def _siblings(self, run: _Run) -> dict[int, _Run]: ...
        def _push_host_leaf(self, run: _Run) -> None: ...
        def _all_runs(self): ...

    def evict(self, n_tokens: int, protect: Sequence[int] = ()) -> int:
        """Evict at least n_tokens (whole pages) of unlocked device leaves, LRU first.

        `protect`: host keys that must survive host eviction (a pending load-back).
        Returns the tokens evicted from the device.
        """
        need = -(-n_tokens // self.page_size)
        if need <= 0:
            return 0
        heap = self._dev_heap
        pop, push = heapq.heappop, heapq.heappush
        host_cap = self.host_capacity_pages
        use_host = host_cap > 0
        write_through = self.write_through
        track = self.sink is not None
        protected = set(protect) if protect else ()
        dropped: list[int] = []
        moved: list[StoredPage] = []
        done = 0
        while done < need and heap:
            t, key, run = pop(heap)
            rk = run.keys
            if run.tier != DEVICE or run.n_dev or run.lock_ref or run.last_access != t or rk[-1] != key:
                continue  # stale entry
            take = self._batch(rk, need - done, t, heap, protected=())
            to_host = False
            if use_host:
                # host slots in use once this page leaves the device: under write_through the
                # remaining device pages hold theirs too (so moving a page leaves it unchanged)
                in_use = self.host_pages + (self.dev_pages - done - 1 if write_through else 0)
                if in_use >= host_cap:
                    self._emit_eviction(dropped, moved)  # keep each key's events in order
                    dropped, moved = [], []
                    take = 1
                    to_host = self._evict_host(1, protected)
                else:
                    to_host = True
                    if not write_through:
                        take = min(take, host_cap - in_use)
            if not to_host and use_host:
                take = 1
            done += take
            gone = rk[-take:]
            gone.reverse()  # leaves go last page first
            dropped.extend(gone)
            if to_host:
                if take < len(rk):
                    upper = self._split(run, len(rk) - take)  # `run` keeps the moved pages
                    upper.last_access = t  # its last page inherits t (its own is no later)
                parent = run.parent
                if track:
                    above = parent.keys[-1] if parent is not None else None
                    moved.extend((k, p, None) for k, p in zip(gone, gone[1:] + [above]))
                run.tier = HOST
                self.host_pages += take
                if parent is not None:
                    parent.n_dev -= 1
                    parent.n_host += 1
                self._push_host_leaf(run)
            else:
                if run.n_host:  # cannot happen: host room is always made by host eviction
                    raise RuntimeError("dropping a device page that has host children")
                if take < len(rk):
                    del rk[-take:]
                    push(heap, (t, rk[-1], run))  # the page before is a leaf now, at time t
                    continue
                parent = run.parent
                self._remove(run)
                if parent is not None:
                    parent.n_dev -= 1
            if parent is not None:
                if t > parent.last_access:
                    parent.last_access = t  # parent inherits the subtree's latest access
                if parent.n_dev == 0 and parent.lock_ref == 0 and parent.tier == DEVICE:
                    push(heap, (parent.last_access, parent.keys[-1], parent))
        self.dev_pages -= done
        self.evicted_pages_total += done
        self._emit_eviction(dropped, moved)
        self._maybe_compact()
        return done * self.page_size

    @staticmethod
    def _batch(rk: list[int], most: int, t: float, heap: list, protected: set[int] | tuple) -> int:
        """How many of a leaf run's last pages (>= 1) go now, at time t: a per-page LRU would take
        them one after the other while each (t, key) sorts before the heap's next entry."""
        take = min(most, len(rk))
        if take > 1 and ((heap and heap[0][0] == t) or protected):
            tie = heap[0][1] if heap and heap[0][0] == t else None
            i = 1
            while i < take:
                k = rk[-1 - i]
                if (tie is not None and not k < tie) or k in protected:
                    break
                i += 1
            take = i
        return take

    def _remove(self, run: _Run) -> None:
        del self._siblings(run)[run.keys[0]]
        run.tier = GONE
        self._runs -= 1

    def _emit_eviction(self, dropped: list[int], moved: list[StoredPage]) -> None:
        if self.sink is not None and dropped:
            self.sink.removed(dropped, MEDIUM_GPU)
            if moved:
                self.sink.stored(moved, MEDIUM_CPU)

    def _evict_host(self, need: int, protected: set[int] | tuple = ()) -> bool:
        heap = self._host_heap
        removed: list[int] = []
        skipped: list[tuple[float, int, _Run]] = []
        count = 0
        while count < need and heap:
            t, key, run = heapq.heappop(heap)
            rk = run.keys
            if run.tier != HOST or run.n_host or run.n_dev or run.last_access != t or rk[-1] != key:
                continue
            if key in protected:
                skipped.append((t, key, run))
                continue
            take = self._batch(rk, need - count, t, heap, protected)
            gone = rk[-take:]
            gone.reverse()
            removed.extend(gone)
            count += take
            self.host_pages -= take
            if take < len(rk):
                del rk[-take:]
                heapq.heappush(heap, (t, rk[-1], run))
                continue
            parent = run.parent
            self._remove(run)
            if parent is not None:
                parent.n_host -= 1
                if t > parent.last_access:
                    parent.last_access = t
                    if parent.tier == DEVICE and parent.n_dev == 0 and parent.lock_ref == 0:
                        heapq.heappush(self._dev_heap, (t, parent.keys[-1], parent))
                self._push_host_leaf(parent)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if self.sink is not None and removed:
            self.sink.removed(removed, MEDIUM_CPU)
        return count >= need

    def _maybe_compact(self) -> None:
        # Stale heap entries pile up under lazy invalidation; rebuild when they dominate.
        limit = 4 * self._runs + 1024
        if len(self._dev_heap) > limit:
            self._dev_heap = [
                (r.last_access, r.keys[-1], r)
                for r in self._all_runs()
                if r.tier == DEVICE and r.n_dev == 0 and r.lock_ref == 0
            ]
            heapq.heapify(self._dev_heap)
        if len(self._host_heap) > limit:
            self._host_heap = [
                (r.last_access, r.keys[-1], r)
                for r in self._all_runs()
                if r.tier == HOST and r.n_dev == 0 and r.n_host == 0
            ]
            heapq.heapify(self._host_heap)
