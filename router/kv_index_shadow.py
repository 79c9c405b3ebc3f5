"""An approximate, capacity-aware shadow of which prefix blocks each replica holds.

Recorded when a replica accepts a request (it answered with a status the router does not retry,
so it will cache the prompt; a refused or unreachable attempt records nothing), bounded per replica
by that replica's KV capacity (max_total_num_tokens) in blocks, LRU. Blocks are touched leaf-first so a prefix's
root is always more recent than its tail: eviction trims conversations from the end, as SGLang's
radix cache evicts leaves, and a surviving root never points at an evicted middle.
Synchronous and lock-free: the event loop is the only writer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

from ..policies.cost import DEFAULT_CAPACITY_TOKENS
from .block_holders import BlockHolders, match_prefix


_ABSENT = object()


class ShadowKVIndex:
    def __init__(self, block_tokens: int = 64, default_capacity_tokens: int = DEFAULT_CAPACITY_TOKENS) -> None:
        self.block_tokens = block_tokens
        self.default_capacity_tokens = default_capacity_tokens
        self._holders = BlockHolders()
        # replica -> its blocks, oldest first. Plain dicts (insertion-ordered; re-inserting a key
        # moves it to the end) of ints are never tracked by the garbage collector; OrderedDicts
        # are, and a full collection walked every entry (~190 ms for 6.8M blocks). The price:
        # evicting one block rescans slots freed since the dict last resized (~2 us, not O(1)).
        self._lru: dict[str, dict[int, None]] = {}
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
            lru = self._lru[replica] = {}
        for block in reversed(blocks):
            known = lru.pop(block, _ABSENT) is None
            lru[block] = None  # now the most recent
            if not known:
                self._holders.add(block, replica)
        self._evict(replica)

    def _evict(self, replica: str) -> None:
        lru = self._lru.get(replica)
        if lru is None:
            return
        limit = self._capacity_blocks.get(replica, self.default_capacity_tokens // self.block_tokens)
        excess = len(lru) - limit
        if excess > 0:  # the oldest, in one pass (each fresh iterator rescans deleted slots)
            for block in list(islice(lru, excess)):
                del lru[block]
                self._holders.discard(block, replica)

    def forget(self, replica: str, blocks: Iterable[int] | None = None) -> None:
        """Drop a replica entirely (removed, flushed) or some of its blocks."""
        lru = self._lru.get(replica)
        if lru is None:
            return
        if blocks is None:
            for block in lru:
                self._holders.discard(block, replica)
            del self._lru[replica]
            return
        for block in blocks:
            if block in lru:
                del lru[block]
                self._holders.discard(block, replica)

    def cached_tokens(self, replica: str) -> int:
        return len(self._lru.get(replica, ())) * self.block_tokens
