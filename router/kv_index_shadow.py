"""An approximate, capacity-aware shadow of which prefix blocks each replica holds.

Recorded when a replica accepts a request (it answered with a status the router does not retry,
so it will cache the prompt; a refused or unreachable attempt records nothing), bounded per replica
by that replica's KV capacity (max_total_num_tokens, else a capacity learnt from its reported cache
hits, else the default) in blocks, LRU. A block is a fixed number of characters; its size in tokens
is per replica (4 characters per token until calibrated, router/learning.py). Blocks are touched leaf-first so a prefix's
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
        self._reported_tokens: dict[str, int] = {}  # max_total_num_tokens, as the replica reports it
        self._learned_tokens: dict[str, int] = {}  # else its effective capacity, learnt
        self._replica_block_tokens: dict[str, float] = {}  # calibrated; else `block_tokens`
        self.learnt_below_reported = False  # a learnt capacity lower than the reported one wins

    def block_tokens_of(self, replica: str) -> float:
        return self._replica_block_tokens.get(replica, self.block_tokens)

    def capacity_tokens(self, replica: str) -> int:
        """The capacity the index bounds the replica's blocks by, in tokens."""
        reported, learnt = self._reported_tokens.get(replica), self._learned_tokens.get(replica)
        if reported and learnt and self.learnt_below_reported:
            return min(reported, learnt)
        return reported or learnt or self.default_capacity_tokens

    def _resize(self, replica: str) -> None:
        blocks = int(self.capacity_tokens(replica) / self.block_tokens_of(replica))
        self._capacity_blocks[replica] = max(1, blocks)
        self._evict(replica)

    def set_capacity(self, replica: str, max_total_num_tokens: int) -> None:
        self._reported_tokens[replica] = max_total_num_tokens
        self._resize(replica)

    def set_learned_capacity(self, replica: str, tokens: int) -> None:
        """An effective capacity learnt from the replica's reported cache hits: it bounds the
        replica's blocks while the replica reports no max_total_num_tokens (or, with
        `learnt_below_reported`, when it is the lower)."""
        self._learned_tokens[replica] = max(1, tokens)
        self._resize(replica)

    def set_block_tokens(self, replica: str, tokens: float) -> None:
        """The replica's calibrated tokens per block: cached-token counts and its capacity in
        blocks follow."""
        self._replica_block_tokens[replica] = max(1.0, tokens)
        self._resize(replica)

    def match(self, blocks: Sequence[int], limit: int | None = None) -> dict[str, int]:
        """Tokens of the longest cached prefix of `blocks` per replica holding any of it: all of
        them, or the `limit` deepest (ties by id)."""
        if not self._replica_block_tokens:
            return match_prefix(self._holders, blocks, limit, self.block_tokens)
        scale = self._replica_block_tokens
        default = self.block_tokens
        return {r: int(depth * scale.get(r, default))
                for r, depth in match_prefix(self._holders, blocks, limit, 1).items()}

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
        return int(len(self._lru.get(replica, ())) * self.block_tokens_of(replica))
