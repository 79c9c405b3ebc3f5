"""An approximate, capacity-aware shadow of which prefix blocks each replica holds.

Recorded at dispatch (the replica will cache the prompt), bounded per replica by that replica's
KV capacity (max_total_num_tokens) in blocks, LRU. Blocks are touched leaf-first so a prefix's
root is always more recent than its tail: eviction trims conversations from the end, as SGLang's
radix cache evicts leaves, and a surviving root never points at an evicted middle.
Synchronous and lock-free: the event loop is the only writer.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol


class ShadowKVIndex:
    def __init__(self, block_tokens: int = 64, default_capacity_tokens: int = 444_672) -> None:
        self.block_tokens = block_tokens
        self.default_capacity_tokens = default_capacity_tokens
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity_blocks: dict[str, int] = {}

    def set_capacity(self, replica: str, max_total_num_tokens: int) -> None:
        self._capacity_blocks[replica] = max(1, max_total_num_tokens // self.block_tokens)
        self._evict(replica)

    def match(self, blocks: Sequence[int], limit: int | None = None) -> dict[str, int]:
        """Tokens of the longest cached prefix of `blocks` per replica holding any of it: all of
        them, or the `limit` deepest (ties by id)."""
        return match_prefix(self._holders, blocks, limit, self.block_tokens)

    def match_host(self, blocks: Sequence[int], limit: int | None = None) -> dict[str, int]:
        return {}  # the shadow cannot tell a host copy from an eviction

    def record(self, replica: str, blocks: Sequence[int]) -> None:
        lru = self._lru.get(replica)
        if lru is None:
            lru = self._lru[replica] = OrderedDict()
        for block in reversed(blocks):
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
                self._holders.setdefault(block, set()).add(replica)
        self._evict(replica)

    def _evict(self, replica: str) -> None:
        lru = self._lru.get(replica)
        if lru is None:
            return
        limit = self._capacity_blocks.get(replica, self.default_capacity_tokens // self.block_tokens)
        while len(lru) > limit:
            block, _ = lru.popitem(last=False)
            self._drop(block, replica)

    def _drop(self, block: int, replica: str) -> None:
        holders = self._holders.get(block)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block]

    def forget(self, replica: str, blocks: Iterable[int] | None = None) -> None:
        """Drop a replica entirely (removed, flushed) or some of its blocks."""
        lru = self._lru.get(replica)
        if lru is None:
            return
        if blocks is None:
            for block in lru:
                self._drop(block, replica)
            del self._lru[replica]
            return
        for block in blocks:
            if block in lru:
                del lru[block]
                self._drop(block, replica)

    def cached_tokens(self, replica: str) -> int:
        return len(self._lru.get(replica, ())) * self.block_tokens


class KVIndex(Protocol):
    """What the routing engine needs from a KV index (shadow or exact)."""

    def match(self, blocks: Sequence[int], limit: int | None = None) -> dict[str, int]: ...
    def match_host(self, blocks: Sequence[int], limit: int | None = None) -> dict[str, int]: ...
    def record(self, replica: str, blocks: Sequence[int]) -> None: ...
    def set_capacity(self, replica: str, max_total_num_tokens: int) -> None: ...
    def forget(self, replica: str) -> None: ...
    def cached_tokens(self, replica: str) -> int: ...


def match_prefix(
    holders: Mapping[int, set[str]], blocks: Sequence[int], limit: int | None, block_tokens: int
) -> dict[str, int]:
    """Tokens of the longest prefix of `blocks` per replica in `holders` (block -> replicas): all
    of them, or the `limit` deepest (ties by id).

    Each replica's blocks are prefix-closed (a block is only ever evicted after its
    descendants), so the holder sets along `blocks` shrink monotonically. Bisecting on where
    they shrink costs O(breakpoints x log n) lookups instead of one set operation per block,
    and visiting deeper intervals first lets `limit` stop before the shallow breakpoint where
    a shared system prompt's holders (possibly the whole fleet) drop out.
    """
    if not blocks:
        return {}
    empty: set[str] = set()
    first = holders.get(blocks[0], empty)
    if not first:
        return {}
    cap = len(first) if limit is None else limit
    matched: dict[str, int] = {}

    def take(group: set[str], depth: int) -> None:
        need = cap - len(matched)
        chosen = group if len(group) <= need else heapq.nsmallest(need, group)
        for replica in sorted(chosen):  # set order varies by process; results must not
            matched[replica] = depth * block_tokens

    last_index = len(blocks) - 1
    last = holders.get(blocks[last_index], empty) & first
    if last:
        take(last, len(blocks))
    stack = [(0, last_index, first, last)]
    while stack and len(matched) < cap:
        lo, hi, at_lo, at_hi = stack.pop()
        if len(at_lo) == len(at_hi):
            continue  # nobody stops holding between lo and hi
        if hi - lo == 1:
            take(at_lo - at_hi, hi)
            continue
        mid = (lo + hi) // 2
        at_mid = holders.get(blocks[mid], empty) & at_lo
        stack.append((lo, mid, at_lo, at_mid))
        stack.append((mid, hi, at_mid, at_hi))  # deeper half first
    return matched
