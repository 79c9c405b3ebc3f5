"""Which replicas hold each KV block, stored so the garbage collector never has to look at it.

An index of a large fleet holds millions of blocks. Kept as `block -> set of replica ids`, every
set is a GC-tracked object, and each full collection walks them all: 0.2-0.9 s with the event
loop stopped at 1000 replicas (measured with gc.callbacks in benchmarks/placement.py's fleet).
Here a block maps to an int bitmask over small replica slots. Ints are not tracked, and a dict of
ints is not either, so the index costs the collector nothing, and a prefix match intersects
holders with one AND instead of a set operation.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from itertools import repeat


class BlockHolders:
    def __init__(self) -> None:
        self._masks: dict[int, int] = {}  # block -> bitmask of slots
        self._slots: dict[str, int] = {}  # replica -> slot
        self._bits: dict[str, int] = {}  # replica -> 1 << slot
        self._ids: list[str] = []  # slot -> replica ("" when free)
        self._free: list[int] = []
        self._held: dict[str, int] = {}  # replica -> blocks it holds; its slot is freed at 0
        self._by_name: list[tuple[str, int]] = []  # (replica, bit) of every slot, by replica

    def mask(self, block: int) -> int:
        return self._masks.get(block, 0)

    def add(self, block: int, replica: str) -> None:
        bit = self._bits.get(replica)
        if bit is None:
            bit = self._claim_slot(replica)
        held = self._masks.get(block, 0)
        if not held & bit:
            self._masks[block] = held | bit
            self._held[replica] += 1

    def add_many(self, blocks: Sequence[int], replica: str) -> None:
        """`add` of each block: one pass, for a record's thousands of new blocks."""
        bit = self._bits.get(replica)
        if bit is None:
            bit = self._claim_slot(replica)
        masks = self._masks
        if masks.keys().isdisjoint(blocks):  # the usual case, blocks nobody holds: no Python loop
            before = len(masks)
            masks.update(zip(blocks, repeat(bit)))
            self._held[replica] += len(masks) - before
            return
        added = {b: h | bit for b, h in zip(blocks, map(masks.get, blocks, repeat(0))) if not h & bit}
        masks.update(added)
        self._held[replica] += len(added)

    def discard_many(self, blocks: Sequence[int], replica: str) -> None:
        """`discard` of each block (each named once): for an eviction's blocks, taken out
        without a Python loop when the replica is their only holder (the usual case), else
        put back without its bit."""
        bit = self._bits.get(replica)
        if bit is None:
            return
        masks = self._masks
        held = list(map(masks.pop, blocks, repeat(0)))
        gone = held.count(bit)
        if gone < len(held):  # blocks others hold too, or not this replica's: put back
            back = {b: h & ~bit for b, h in zip(blocks, held) if h != bit and h}
            masks.update(back)
            gone += sum(1 for h in held if h != bit and h & bit)
        if gone:
            self._held[replica] -= gone
            if not self._held[replica]:
                self._free_slot(replica)

    def discard(self, block: int, replica: str) -> None:
        bit = self._bits.get(replica)
        held = self._masks.get(block, 0)
        if bit is None or not held & bit:
            return
        held ^= bit
        if held:
            self._masks[block] = held
        else:
            del self._masks[block]
        self._held[replica] -= 1
        if not self._held[replica]:
            self._free_slot(replica)

    def replicas(self, mask: int) -> list[str]:
        """The replicas of a mask, in slot order."""
        out, ids, base = [], self._ids, 0
        while mask:
            word = mask & 0xFFFFFFFFFFFFFFFF
            while word:
                low = word & -word
                out.append(ids[base + low.bit_length() - 1])
                word ^= low
            mask >>= 64
            base += 64
        return out

    def slot_count(self) -> int:
        """Replicas holding at least one block."""
        return len(self._by_name)

    def first_by_name(self, mask: int, n: int) -> list[str]:
        """The `n` alphabetically first replicas of a mask, in order. Walks replicas by name and
        stops at the n-th holder: cheap when the mask holds a good part of the fleet."""
        out: list[str] = []
        for replica, bit in self._by_name:
            if mask & bit:
                out.append(replica)
                if len(out) == n:
                    break
        return out

    def _claim_slot(self, replica: str) -> int:
        slot = heapq.heappop(self._free) if self._free else len(self._ids)
        if slot == len(self._ids):
            self._ids.append(replica)
        else:
            self._ids[slot] = replica
        self._slots[replica] = slot
        self._bits[replica] = bit = 1 << slot
        self._held[replica] = 0
        bisect.insort(self._by_name, (replica, bit))
        return bit

    def _free_slot(self, replica: str) -> None:
        slot = self._slots.pop(replica)
        bit = self._bits.pop(replica)
        del self._held[replica]
        self._by_name.remove((replica, bit))
        self._ids[slot] = ""
        heapq.heappush(self._free, slot)  # lowest first: masks stay short


def match_prefix(
    holders: BlockHolders, blocks: Sequence[int], limit: int | None, block_tokens: int
) -> dict[str, int]:
    """Tokens of the longest prefix of `blocks` per replica holding any of it: all of them, or the
    `limit` deepest (ties by id).

    Each replica's blocks are prefix-closed (a block is only ever evicted after its
    descendants), so the holder sets along `blocks` shrink monotonically. Bisecting on where
    they shrink costs O(breakpoints x log n) lookups instead of one per block, and visiting
    deeper intervals first lets `limit` stop before the shallow breakpoint where a shared system
    prompt's holders (possibly the whole fleet) drop out.
    """
    if not blocks:
        return {}
    masks = holders._masks.get  # `holders.mask`, without a Python call per lookup
    first = masks(blocks[0], 0)
    if not first:
        return {}
    cap = first.bit_count() if limit is None else limit
    matched: dict[str, int] = {}

    def take(group: int, depth: int) -> None:
        need = cap - len(matched)
        count = group.bit_count()
        if count > need and count * 4 >= holders.slot_count():
            # A dense group (a shared system prompt's holders, up to the whole fleet): walking
            # replicas by name to the need-th holder beats listing every holder and picking.
            chosen = holders.first_by_name(group, need)
        else:
            ids = holders.replicas(group)
            chosen = sorted(ids if count <= need else heapq.nsmallest(need, ids))
        for replica in chosen:
            matched[replica] = depth * block_tokens

    last_index = len(blocks) - 1
    last = masks(blocks[last_index], 0) & first
    if last:
        take(last, len(blocks))
    # Intervals (lo, hi, holders at lo, holders at hi) where somebody stops holding, deepest on
    # top. The deeper half of an interval is walked at once (it would be popped next), and the
    # shallower one is kept only if somebody stops in it: an append turn's one breakpoint costs
    # a lookup per halving and nothing pushed.
    stack = [(0, last_index, first, last)]
    while stack and len(matched) < cap:
        lo, hi, at_lo, at_hi = stack.pop()
        lo_count, hi_count = at_lo.bit_count(), at_hi.bit_count()
        while lo_count != hi_count:  # somebody stops holding between lo and hi
            if hi - lo == 1:
                take(at_lo & ~at_hi, hi)
                break
            mid = (lo + hi) // 2
            at_mid = masks(blocks[mid], 0) & at_lo
            mid_count = at_mid.bit_count()
            if mid_count != lo_count:
                stack.append((lo, mid, at_lo, at_mid))  # after the deeper half
            lo, at_lo, lo_count = mid, at_mid, mid_count
    return matched
