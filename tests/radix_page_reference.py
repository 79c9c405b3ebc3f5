"""Reference model for tests: the radix cache with one node per page (loadtest/radix_cache.py keeps
one node per run of pages and must behave exactly like this).

Page i of a sequence has key_i = H(key_{i-1}, tokens of page i) and key_{-1} = H(namespace), so a key
names its whole prefix: the tree is a flat dict {key: node}, a path is a list of keys, and two
namespaces (model, lora, extra_key, cache_salt) never share a page.

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

Cost: presence and tier are prefix-closed along a path, so `match` is a binary search (O(log n)
lookups). Access time is written on the deepest touched node only; an evicted child passes its
time up to its parent, which therefore holds the subtree's latest access when it becomes a leaf,
exactly the order SGLang gets by stamping every node on the path. Eviction pops a heap with lazy
invalidation (stale entries are skipped), O(log n) amortised per page. Lock/unlock walk the path.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Sequence
from typing import Protocol

DEVICE = 0
HOST = 1
# StorageMedium values in python/sglang/srt/disaggregation/kv_events.py
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU_PINNED"

_MASK = (1 << 64) - 1


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


class _Node:
    __slots__ = ("parent", "n_dev", "n_host", "last_access", "lock_ref", "tier")

    def __init__(self, parent: int | None, last_access: float, tier: int) -> None:
        self.parent = parent
        self.n_dev = 0  # children on the device
        self.n_host = 0  # children on host only
        self.last_access = last_access
        self.lock_ref = 0
        self.tier = tier


class RadixCache:
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
        self._nodes: dict[int, _Node] = {}
        self._dev_heap: list[tuple[float, int]] = []
        self._host_heap: list[tuple[float, int]] = []
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
        return len(self._nodes)

    def __contains__(self, key: int) -> bool:
        return key in self._nodes

    def tier_of(self, key: int) -> int | None:
        node = self._nodes.get(key)
        return None if node is None else node.tier

    # ---- match ---------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], max_pages: int, now: float) -> tuple[int, int]:
        """(device pages, host pages) of the longest cached prefix of `keys[:max_pages]`."""
        nodes = self._nodes
        n = min(len(keys), max_pages)
        lo, hi = 0, n  # largest m with keys[:m] all present (presence is prefix-closed)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if keys[mid - 1] in nodes:
                lo = mid
            else:
                hi = mid - 1
        total = lo
        if total == 0:
            return 0, 0
        lo, hi = 0, total  # device pages are a prefix of the present ones
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if nodes[keys[mid - 1]].tier == DEVICE:
                lo = mid
            else:
                hi = mid - 1
        dev = lo
        if dev:
            self._touch(keys[dev - 1], now)
        if total > dev:
            nodes[keys[total - 1]].last_access = now
            self._push_host_leaf(keys[total - 1])
        return dev, total - dev

    def _touch(self, key: int, now: float) -> None:
        node = self._nodes[key]
        node.last_access = now
        if node.n_dev == 0 and node.lock_ref == 0:
            heapq.heappush(self._dev_heap, (now, key))
            self._maybe_compact()

    def _push_host_leaf(self, key: int) -> None:
        node = self._nodes[key]
        if node.tier == HOST and node.n_host == 0 and node.n_dev == 0:
            heapq.heappush(self._host_heap, (node.last_access, key))

    # ---- locks ---------------------------------------------------------------------------------
    def lock(self, keys: Sequence[int], start: int, end: int) -> None:
        """Pin device pages keys[start:end] (a running request holds them)."""
        # lock/unlock walk every page of a ~100k-token path per request: iterate nodes via map()
        # over a slice rather than indexing keys[i] in a range loop (the simulator's hot spot).
        newly = 0
        for node in map(self._nodes.__getitem__, keys[start:end]):
            if not node.lock_ref:
                newly += 1
            node.lock_ref += 1
        self.locked_pages += newly

    def unlock(self, keys: Sequence[int], start: int, end: int) -> None:
        nodes = self._nodes
        heap = self._dev_heap
        freed = 0
        span = keys[start:end]
        for key, node in zip(span, map(nodes.__getitem__, span)):
            node.lock_ref -= 1
            if not node.lock_ref:
                freed += 1
                if not node.n_dev:
                    heapq.heappush(heap, (node.last_access, key))
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
        nodes = self._nodes
        ps = self.page_size
        sink = self.sink
        parent = keys[start - 1] if start > 0 else None
        # The parent's node is carried along the path (one dict lookup per page, not two).
        parent_node = nodes[parent] if parent is not None else None
        stored: list[tuple[int, int | None, Sequence[int] | None]] = []
        revived: list[int] = []
        added = 0
        newly_locked = 0
        for i in range(start, end):
            key = keys[i]
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = _Node(parent, now, DEVICE)
                if parent_node is not None:
                    parent_node.n_dev += 1
                added += 1
                if sink is not None:
                    stored.append((key, parent, token_ids[i * ps : (i + 1) * ps] if token_ids else None))
            elif node.tier == HOST:
                node.tier = DEVICE
                self.host_pages -= 1
                if parent_node is not None:
                    parent_node.n_host -= 1
                    parent_node.n_dev += 1
                added += 1
                if sink is not None:
                    revived.append(key)
                    stored.append((key, parent, token_ids[i * ps : (i + 1) * ps] if token_ids else None))
            if lock:
                if not node.lock_ref:
                    newly_locked += 1
                node.lock_ref += 1
            parent = key
            parent_node = node
        self.dev_pages += added
        self.locked_pages += newly_locked
        self._touch(keys[end - 1], now)
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

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, n_tokens: int, protect: Sequence[int] = ()) -> int:
        """Evict at least n_tokens (whole pages) of unlocked device leaves, LRU first.

        `protect`: host keys that must survive host eviction (a pending load-back).
        Returns the tokens evicted from the device.
        """
        need = -(-n_tokens // self.page_size)
        if need <= 0:
            return 0
        nodes = self._nodes
        heap = self._dev_heap
        pop, push = heapq.heappop, heapq.heappush
        host_cap = self.host_capacity_pages
        use_host = host_cap > 0
        write_through = self.write_through
        protected = set(protect) if protect else ()
        dropped: list[int] = []
        moved: list[tuple[int, int | None, Sequence[int] | None]] = []
        done = 0
        while done < need and heap:
            t, key = pop(heap)
            node = nodes.get(key)
            if (
                node is None
                or node.tier != DEVICE
                or node.n_dev
                or node.lock_ref
                or node.last_access != t
            ):
                continue  # stale entry
            done += 1
            parent = node.parent
            pn = nodes[parent] if parent is not None else None
            if use_host:
                # host slots in use once this page leaves the device: under write_through the
                # remaining device pages hold theirs too
                in_use = self.host_pages + (self.dev_pages - done if write_through else 0)
                if in_use >= host_cap:
                    self._emit_eviction(dropped, moved)  # keep each key's events in order
                    dropped, moved = [], []
            if use_host and (in_use < host_cap or self._evict_host(1, protected)):
                node.tier = HOST
                self.host_pages += 1
                if pn is not None:
                    pn.n_dev -= 1
                    pn.n_host += 1
                self._push_host_leaf(key)
                moved.append((key, parent, None))
            else:
                if node.n_host:  # cannot happen: host room is always made by host eviction
                    raise RuntimeError("dropping a device page that has host children")
                del nodes[key]
                if pn is not None:
                    pn.n_dev -= 1
            dropped.append(key)
            if pn is not None:
                if t > pn.last_access:
                    pn.last_access = t  # parent inherits the subtree's latest access
                if pn.n_dev == 0 and pn.lock_ref == 0 and pn.tier == DEVICE:
                    push(heap, (pn.last_access, parent))
        self.dev_pages -= done
        self.evicted_pages_total += done
        self._emit_eviction(dropped, moved)
        self._maybe_compact()
        return done * self.page_size

    def _emit_eviction(
        self, dropped: list[int], moved: list[tuple[int, int | None, Sequence[int] | None]]
    ) -> None:
        if self.sink is not None and dropped:
            self.sink.removed(dropped, MEDIUM_GPU)
            if moved:
                self.sink.stored(moved, MEDIUM_CPU)

    def _evict_host(self, need: int, protected: set[int] | tuple = ()) -> bool:
        nodes = self._nodes
        heap = self._host_heap
        removed: list[int] = []
        skipped: list[tuple[float, int]] = []
        while len(removed) < need and heap:
            t, key = heapq.heappop(heap)
            node = nodes.get(key)
            if node is None or node.tier != HOST or node.n_host or node.n_dev or node.last_access != t:
                continue
            if key in protected:
                skipped.append((t, key))
                continue
            del nodes[key]
            self.host_pages -= 1
            removed.append(key)
            parent = node.parent
            if parent is not None:
                pn = nodes[parent]
                pn.n_host -= 1
                if t > pn.last_access:
                    pn.last_access = t
                    if pn.tier == DEVICE and pn.n_dev == 0 and pn.lock_ref == 0:
                        heapq.heappush(self._dev_heap, (t, parent))
                self._push_host_leaf(parent)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if self.sink is not None and removed:
            self.sink.removed(removed, MEDIUM_CPU)
        return len(removed) >= need

    def _maybe_compact(self) -> None:
        # Stale heap entries pile up under lazy invalidation; rebuild when they dominate.
        if len(self._dev_heap) > 4 * len(self._nodes) + 1024:
            self._dev_heap = [
                (n.last_access, k)
                for k, n in self._nodes.items()
                if n.tier == DEVICE and n.n_dev == 0 and n.lock_ref == 0
            ]
            heapq.heapify(self._dev_heap)
        if len(self._host_heap) > 4 * len(self._nodes) + 1024:
            self._host_heap = [
                (n.last_access, k)
                for k, n in self._nodes.items()
                if n.tier == HOST and n.n_dev == 0 and n.n_host == 0
            ]
            heapq.heapify(self._host_heap)

    def check_invariants(self) -> None:
        """O(n) self-check for tests: counters, child counts, tier order along every path."""
        n_dev: dict[int, int] = {}
        n_host: dict[int, int] = {}
        for node in self._nodes.values():
            if node.parent is not None:
                parent = self._nodes[node.parent]  # prefix-closed
                assert not (parent.tier == HOST and node.tier == DEVICE), "device page under host"
                counts = n_dev if node.tier == DEVICE else n_host
                counts[node.parent] = counts.get(node.parent, 0) + 1
            assert node.lock_ref >= 0 and (node.lock_ref == 0 or node.tier == DEVICE)
        for key, node in self._nodes.items():
            assert (node.n_dev, node.n_host) == (n_dev.get(key, 0), n_host.get(key, 0))
        tiers = [n.tier for n in self._nodes.values()]
        assert self.dev_pages == tiers.count(DEVICE) and self.host_pages == tiers.count(HOST)
        assert self.locked_pages == sum(1 for n in self._nodes.values() if n.lock_ref)
        assert self.host_pages <= self.host_capacity_pages or self.host_capacity_pages == 0
        if self.write_through and self.dev_pages <= self.host_capacity_pages:
            assert self.dev_pages + self.host_pages <= self.host_capacity_pages, "host copies overflow"

    def flush(self) -> None:
        """Drop everything (SGLang's /flush_cache, allowed only when nothing runs)."""
        if self.locked_pages:
            raise RuntimeError("flush with locked pages")
        self._nodes.clear()
        self._dev_heap.clear()
        self._host_heap.clear()
        self.dev_pages = self.host_pages = 0
        if self.sink is not None:
            self.sink.cleared()
