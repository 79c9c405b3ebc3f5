"""A paged prefix cache with SGLang's radix-cache semantics, keyed by chained page hashes.

Page i of a sequence has key_i = H(key_{i-1}, tokens of page i) and key_{-1} = H(namespace), so a key
names its whole prefix and two namespaces (model, lora, extra_key, cache_salt) never share a page.

Semantics kept from `mem_cache/radix_cache.py` and `hiradix_cache.py`:
- matches and inserts are whole pages (the caller caps a match at (len-1)//page pages);
- eviction happens only when an allocation needs room, LRU over leaves (no child on the device) that
  no running request holds (lock_ref == 0);
- with a host tier (HiCache), a page evicted from the device moves to host if host has room
  (host LRU evicts host leaves for it); along any path device pages come first, then host pages,
  so a match is "device prefix, then host prefix"; host hits are loaded back to the device.
- write_through (SGLang's default `--hicache-write-policy`, `write_through_threshold = 1` in
  `mem_cache/unified_radix_cache.py`) backs every device page up to host as it is inserted, so
  the host pool holds a copy of each device page plus the host-only pages: dev + host <= host
  capacity, and unique cached pages are bounded by the host pool, not device + host. A device
  page evicted under write_through already has its host slot (no host room needed); a new device
  page takes one (the host LRU evicts a host-only leaf for it). Without write_through (write_back)
  a page takes a host slot only when it is evicted from the device.

Structure: a path-compressed radix tree, as SGLang keeps one node per run of tokens. A `_Run`
holds a run of pages that share tier, lock count and eviction time; a run is split where a match,
a lock or a tier change ends inside it. So a ~1,500-page context costs a handful of nodes, and
lock/unlock/insert walk runs, not pages. What stays per page is what SGLang publishes per page:
KV events, and the eviction order.

Eviction order is exactly the per-page one. Access time is written on the deepest touched page
only (the run is split there); an evicted child passes its time up to its parent, which therefore
holds the subtree's latest access when it becomes a leaf, the order SGLang gets by stamping every
node on the path. Every page inside a run has an access time <= the run's (the run's last page's),
so once the last page goes, the page before it is a leaf with the run's time: a run's pages leave
tail first at one time, and the LRU is a heap of (time, last page key) over leaf runs, taken a
batch of pages at a time while they stay ahead of the heap's next entry (ties go by page key,
as a per-page heap orders them). Stale heap entries are skipped (lazy invalidation).
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Iterator, Sequence
from typing import Protocol

from .radix_eviction import DEVICE, GONE, HOST, MEDIUM_CPU, MEDIUM_GPU, EvictionMixin

__all__ = [
    "DEVICE", "HOST", "MEDIUM_CPU", "MEDIUM_GPU", "KVSink", "RadixCache", "chain_keys", "page_keys",
    "root_key",
]

_MASK = (1 << 64) - 1

StoredPage = tuple[int, "int | None", "Sequence[int] | None"]  # (key, parent key, tokens)


class KVSink(Protocol):
    def stored(self, pages: list[tuple[int, int | None, Sequence[int] | None]], medium: str) -> None: ...
    def removed(self, keys: list[int], medium: str) -> None: ...
    def cleared(self) -> None: ...


def root_key(namespace: str) -> int:
    digest = hashlib.blake2b(namespace.encode("utf-8"), digest_size=8, person=b"kvr-root").digest()
    return int.from_bytes(digest, "little")


def chain_keys(parent: int, tokens: Sequence[int], page_size: int, start_page: int = 0) -> list[int]:
    """Keys of the full pages of `tokens` from `start_page` on; `parent` is the key before it."""
    keys: list[int] = []
    prev = parent.to_bytes(8, "little")
    blake = hashlib.blake2b
    for i in range(start_page * page_size, len(tokens) - page_size + 1, page_size):
        page = array("I", tokens[i : i + page_size]).tobytes()
        prev = blake(prev + page, digest_size=8).digest()
        keys.append(int.from_bytes(prev, "little"))
    return keys


def page_keys(tokens: Sequence[int], page_size: int, namespace: str = "") -> list[int]:
    """Chained keys of every full page of `tokens` (deterministic across processes)."""
    return chain_keys(root_key(namespace), tokens, page_size)


class _Run:
    """Consecutive pages of one path: each page but the last has exactly one child, the next."""

    __slots__ = ("keys", "parent", "children", "n_dev", "n_host", "last_access", "lock_ref", "tier")

    def __init__(self, keys: list[int], parent: _Run | None, last_access: float, tier: int, lock_ref: int) -> None:
        self.keys = keys
        self.parent = parent
        self.children: dict[int, _Run] = {}  # child runs of the last page, by their first key
        self.n_dev = 0  # child runs on the device
        self.n_host = 0  # child runs on host only
        self.last_access = last_access  # the last page's; every other page's is <= it
        self.lock_ref = lock_ref
        self.tier = tier

    def __lt__(self, other: _Run) -> bool:
        return False  # heap entries (time, key, run) with equal time and key are the same page


class RadixCache(EvictionMixin):
    def __init__(
        self,
        page_size: int,
        device_capacity_tokens: int,
        host_capacity_tokens: int = 0,
        sink: KVSink | None = None,
        *,
        write_through: bool = True,
    ) -> None:
        self.page_size = page_size
        self.write_through = write_through and host_capacity_tokens > 0
        self.device_capacity_pages = device_capacity_tokens // page_size
        self.host_capacity_pages = host_capacity_tokens // page_size
        self.sink = sink
        self._top: dict[int, _Run] = {}  # runs starting at page 0, by first key
        self._runs = 0
        self._dev_heap: list[tuple[float, int, _Run]] = []
        self._host_heap: list[tuple[float, int, _Run]] = []
        self.dev_pages = 0
        self.locked_pages = 0
        self.host_pages = 0
        self.evicted_pages_total = 0  # device pages evicted (moved to host or dropped)

    # ---- sizes in tokens -------------------------------------------------------------------
    @property
    def device_tokens(self) -> int:
        return self.dev_pages * self.page_size

    @property
    def evictable_tokens(self) -> int:
        return (self.dev_pages - self.locked_pages) * self.page_size

    @property
    def locked_tokens(self) -> int:
        return self.locked_pages * self.page_size

    @property
    def host_tokens(self) -> int:
        """Host-only tokens (pages not on the device)."""
        return self.host_pages * self.page_size

    @property
    def unique_capacity_tokens(self) -> int:
        """Most distinct tokens device and host can hold together."""
        dev = self.device_capacity_pages
        host = self.host_capacity_pages
        pages = max(dev, host) if self.write_through else dev + host
        return pages * self.page_size

    def __len__(self) -> int:
        return self.dev_pages + self.host_pages

    def __contains__(self, key: int) -> bool:
        return self.tier_of(key) is not None

    def tier_of(self, key: int) -> int | None:
        """Tier of one page (a scan of the tree: for tests and checks)."""
        for run in self._all_runs():
            if key in run.keys:
                return run.tier
        return None

    def _all_runs(self) -> Iterator[_Run]:
        stack = list(self._top.values())
        while stack:
            run = stack.pop()
            yield run
            stack.extend(run.children.values())

    # ---- tree walks ----------------------------------------------------------------------------
    def _siblings(self, run: _Run) -> dict[int, _Run]:
        return run.parent.children if run.parent is not None else self._top

    def _split(self, run: _Run, j: int) -> _Run:
        """Cut `run` before its page j (0 < j < len); returns the new upper run, pages [:j].

        The lower part keeps the run object, so its children and heap entries stay valid. The
        upper part's last page gets the run's time: its own is no later, and it can only become
        a leaf after the lower part has passed that time up to it."""
        upper = _Run(run.keys[:j], run.parent, run.last_access, run.tier, run.lock_ref)
        del run.keys[:j]
        self._siblings(run)[upper.keys[0]] = upper
        upper.children[run.keys[0]] = run
        if run.tier == DEVICE:
            upper.n_dev = 1
        else:
            upper.n_host = 1
        run.parent = upper
        self._runs += 1
        return upper

    def _walk(self, keys: Sequence[int], n: int) -> tuple[list[_Run], int]:
        """Runs along keys[:n] as far as cached, and the pages matched (the last run may go on)."""
        path: list[_Run] = []
        d = 0
        children = self._top
        while d < n:
            run = children.get(keys[d])
            if run is None:
                break
            rk = run.keys
            m = len(rk)
            path.append(run)
            if d + m <= n and keys[d + m - 1] == rk[-1]:  # a key names its prefix: all m match
                d += m
                children = run.children
                continue
            lo, hi = 1, min(m, n - d)  # largest j with keys[d:d+j] == rk[:j]
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if keys[d + mid - 1] == rk[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            d += lo
            break
        return path, d

    def _span(self, keys: Sequence[int], start: int, end: int) -> list[_Run]:
        """The runs that hold exactly pages keys[start:end] (all cached), split at both ends."""
        runs: list[_Run] = []
        d = 0
        children = self._top
        while d < end:
            run = children[keys[d]]
            m = len(run.keys)
            if d < start < d + m:
                self._split(run, start - d)
                m -= start - d
                d = start
            if d + m > end:
                run = self._split(run, end - d)
                m = end - d
            if d >= start:
                runs.append(run)
            d += m
            children = run.children
        return runs

    def _run_at(self, path: list[_Run], keys: Sequence[int], depth: int) -> _Run:
        """The run of `path` holding page `depth`, split so that the page is its last one."""
        d = 0
        for i, run in enumerate(path):
            m = len(run.keys)
            if depth < d + m:
                if depth < d + m - 1:
                    upper = self._split(run, depth - d + 1)
                    path[i:i + 1] = [upper, run]  # keep `path` true for the caller
                    return upper
                return run
            d += m
        raise KeyError(keys[depth])

    # ---- match ---------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], max_pages: int, now: float) -> tuple[int, int]:
        """(device pages, host pages) of the longest cached prefix of `keys[:max_pages]`."""
        path, total = self._walk(keys, min(len(keys), max_pages))
        if total == 0:
            return 0, 0
        dev = 0
        for run in path:  # device runs come first along a path
            if run.tier != DEVICE:
                break
            dev += len(run.keys)
        dev = min(dev, total)
        if dev:
            self._touch(self._run_at(path, keys, dev - 1), now)
        if total > dev:
            run = self._run_at(path, keys, total - 1)
            run.last_access = now
            self._push_host_leaf(run)
        return dev, total - dev

    def _touch(self, run: _Run, now: float) -> None:
        run.last_access = now
        if run.n_dev == 0 and run.lock_ref == 0:
            heapq.heappush(self._dev_heap, (now, run.keys[-1], run))
            self._maybe_compact()

    def _push_host_leaf(self, run: _Run) -> None:
        if run.tier == HOST and run.n_host == 0 and run.n_dev == 0:
            heapq.heappush(self._host_heap, (run.last_access, run.keys[-1], run))

    # ---- locks ---------------------------------------------------------------------------------
    def lock(self, keys: Sequence[int], start: int, end: int) -> None:
        """Pin device pages keys[start:end] (a running request holds them)."""
        if end <= start:
            return
        newly = 0
        for run in self._span(keys, start, end):
            if not run.lock_ref:
                newly += len(run.keys)
            run.lock_ref += 1
        self.locked_pages += newly

    def unlock(self, keys: Sequence[int], start: int, end: int) -> None:
        if end <= start:
            return
        heap = self._dev_heap
        freed = 0
        for run in self._span(keys, start, end):
            run.lock_ref -= 1
            if not run.lock_ref:
                freed += len(run.keys)
                if not run.n_dev:
                    heapq.heappush(heap, (run.last_access, run.keys[-1], run))
        self.locked_pages -= freed
        self._maybe_compact()

    # ---- insert / load back --------------------------------------------------------------------
    def insert(
        self,
        keys: Sequence[int],
        start: int,
        end: int,
        now: float,
        *,
        lock: bool = False,
        token_ids: Sequence[int] | None = None,
    ) -> int:
        """Put pages keys[start:end] on the device; keys[:start] must already be there.

        Pages already on the device are kept (the caller frees its duplicate copy), pages on host
        are revived with the caller's copy. With lock=True every page in the range gets one more
        lock_ref. Returns the number of pages that were not on the device before.
        """
        if end <= start:
            return 0
        path, present = self._walk(keys, end)
        if present > start:
            runs = self._span(keys, start, present)  # split so the range starts and ends a run
            parent = runs[-1]
        else:
            runs = []
            parent = self._run_at(path, keys, start - 1) if start > 0 else None
        track = self.sink is not None
        stored: list[StoredPage] = []
        revived: list[int] = []
        added = 0
        newly_locked = 0
        d = start
        for run in runs:
            m = len(run.keys)
            if run.tier == HOST:
                run.tier = DEVICE
                self.host_pages -= m
                if run.parent is not None:
                    run.parent.n_host -= 1
                    run.parent.n_dev += 1
                added += m
                if track:
                    revived.extend(run.keys)
                    stored.extend(self._stored_pages(keys, d, d + m, token_ids))
            if lock:
                if not run.lock_ref:
                    newly_locked += m
                run.lock_ref += 1
            d += m
        if present < end:  # the rest is new: one run under the last cached page
            new = _Run(list(keys[present:end]), parent, now, DEVICE, 1 if lock else 0)
            self._siblings(new)[new.keys[0]] = new
            if parent is not None:
                parent.n_dev += 1
            self._runs += 1
            added += end - present
            if lock:
                newly_locked += end - present
            if track:
                stored.extend(self._stored_pages(keys, present, end, token_ids))
            parent = new
        self.dev_pages += added
        self.locked_pages += newly_locked
        self._touch(parent, now)  # type: ignore[arg-type]  # end > start: some run holds end-1
        if self.write_through:
            # new device pages take host slots (revived ones keep theirs): evict host-only leaves
            over = self.dev_pages + self.host_pages - self.host_capacity_pages
            if over > 0:
                self._evict_host(over)
        if self.sink is not None:
            if revived:
                self.sink.removed(revived, MEDIUM_CPU)
            if stored:
                self.sink.stored(stored, MEDIUM_GPU)
        return added

    def _stored_pages(
        self, keys: Sequence[int], lo: int, hi: int, token_ids: Sequence[int] | None
    ) -> list[StoredPage]:
        ps = self.page_size
        return [
            (keys[i], keys[i - 1] if i else None, token_ids[i * ps : (i + 1) * ps] if token_ids else None)
            for i in range(lo, hi)
        ]

    def check_invariants(self) -> None:
        """O(n) self-check for tests: counters, child counts, tier and lock order along paths."""
        dev = host = locked = runs = 0
        for run in self._all_runs():
            runs += 1
            assert run.keys and run.tier in (DEVICE, HOST)
            assert self._siblings(run).get(run.keys[0]) is run
            assert run.lock_ref >= 0 and (run.lock_ref == 0 or run.tier == DEVICE)
            n_dev = n_host = 0
            for first, child in run.children.items():
                assert child.parent is run and child.keys[0] == first
                assert not (run.tier == HOST and child.tier == DEVICE), "device page under host"
                assert child.lock_ref <= run.lock_ref, "a lock covers a whole prefix"
                if child.tier == DEVICE:
                    n_dev += 1
                else:
                    n_host += 1
            assert (run.n_dev, run.n_host) == (n_dev, n_host)
            if run.tier == DEVICE:
                dev += len(run.keys)
            else:
                host += len(run.keys)
            if run.lock_ref:
                locked += len(run.keys)
        assert runs == self._runs
        assert self.dev_pages == dev and self.host_pages == host and self.locked_pages == locked
        assert self.host_pages <= self.host_capacity_pages or self.host_capacity_pages == 0
        if self.write_through and self.dev_pages <= self.host_capacity_pages:
            assert self.dev_pages + self.host_pages <= self.host_capacity_pages, "host copies overflow"

    def flush(self) -> None:
        """Drop everything (SGLang's /flush_cache, allowed only when nothing runs)."""
        if self.locked_pages:
            raise RuntimeError("flush with locked pages")
        for run in self._all_runs():
            run.tier = GONE
        self._top.clear()
        self._runs = 0
        self._dev_heap.clear()
        self._host_heap.clear()
        self.dev_pages = self.host_pages = 0
        if self.sink is not None:
            self.sink.cleared()
