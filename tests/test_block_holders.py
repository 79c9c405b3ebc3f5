"""BlockHolders (bitmask holders) and its match_prefix against the set-based original."""

from __future__ import annotations

import gc
import heapq
import random

from kvrouter.router.block_holders import BlockHolders, match_prefix


def match_with_sets(holders: dict[int, set[str]], blocks, limit, block_tokens):
    """The previous implementation (block -> set of replicas), kept as the reference."""
    if not blocks:
        return {}
    empty: set[str] = set()
    first = holders.get(blocks[0], empty)
    if not first:
        return {}
    cap = len(first) if limit is None else limit
    matched: dict[str, int] = {}

    def take(group, depth):
        need = cap - len(matched)
        chosen = group if len(group) <= need else heapq.nsmallest(need, group)
        for replica in sorted(chosen):
            matched[replica] = depth * block_tokens

    last_index = len(blocks) - 1
    last = holders.get(blocks[last_index], empty) & first
    if last:
        take(last, len(blocks))
    stack = [(0, last_index, first, last)]
    while stack and len(matched) < cap:
        lo, hi, at_lo, at_hi = stack.pop()
        if len(at_lo) == len(at_hi):
            continue
        if hi - lo == 1:
            take(at_lo - at_hi, hi)
            continue
        mid = (lo + hi) // 2
        at_mid = holders.get(blocks[mid], empty) & at_lo
        stack.append((lo, mid, at_lo, at_mid))
        stack.append((mid, hi, at_mid, at_hi))
    return matched


def test_same_matches_as_sets_in_the_same_order():
    """Random holders (prefix-closed or not), random adds and removals, every limit: the dict
    returned, insertion order included, equals the set-based one's."""
    rng = random.Random(11)
    for _ in range(300):
        replicas = [f"r{i}" for i in range(rng.randrange(1, 140))]
        blocks = list(range(rng.randrange(1, 30)))
        bits, sets = BlockHolders(), {}
        for _ in range(rng.randrange(1, 400)):
            block, replica = rng.choice(blocks), rng.choice(replicas)
            if rng.random() < 0.7:
                bits.add(block, replica)
                sets.setdefault(block, set()).add(replica)
            else:
                bits.discard(block, replica)
                if replica in sets.get(block, ()):
                    sets[block].discard(replica)
                    if not sets[block]:
                        del sets[block]
        for block in blocks:
            assert sorted(bits.replicas(bits.mask(block))) == sorted(sets.get(block, ()))
        for limit in (None, 1, 3, 32):
            query = rng.sample(blocks, rng.randrange(1, len(blocks) + 1))
            got = match_prefix(bits, query, limit, 64)
            want = match_with_sets(sets, query, limit, 64)
            assert list(got.items()) == list(want.items())


def test_fleet_wide_prefix_picks_the_first_names_like_the_sets():
    """A block the whole fleet holds (a shared system prompt) and a few deeper holders; slots
    reused so slot order differs from name order: the `limit` chosen are the same as the sets'."""
    rng = random.Random(5)
    for _ in range(50):
        names = [f"replica-{rng.randrange(10_000):05d}" for _ in range(rng.randrange(40, 300))]
        bits, sets = BlockHolders(), {}
        for name in names:
            bits.add(0, name)
            sets.setdefault(0, set()).add(name)
        for name in rng.sample(names, len(names) // 5):  # free slots, then hand them to others
            bits.discard(0, name)
            sets[0].discard(name)
        for name in rng.sample(names, len(names) // 5):
            bits.add(0, name)
            sets[0].add(name)
        for block in (1, 2):
            for name in rng.sample(sorted(sets[0]), 3):
                bits.add(block, name)
                sets.setdefault(block, set()).add(name)
        for limit in (1, 8, 32, None):
            got = match_prefix(bits, [0, 1, 2], limit, 64)
            assert list(got.items()) == list(match_with_sets(sets, [0, 1, 2], limit, 64).items())


def test_slots_are_reused_and_masks_stay_short():
    holders = BlockHolders()
    for i in range(100):
        holders.add(1, f"r{i}")
    for i in range(100):
        holders.discard(1, f"r{i}")
    assert holders.mask(1) == 0
    holders.add(2, "late")
    assert holders.mask(2) == 1  # the lowest free slot
    assert holders.replicas(holders.mask(2)) == ["late"]


def test_the_collector_never_tracks_the_holders():
    holders = BlockHolders()
    for block in range(10_000):
        holders.add(block, f"r{block % 7}")
    gc.collect()
    assert not gc.is_tracked(holders._masks)


def test_shadow_index_lru_order_and_gc_untracked():
    """The shadow index keeps exactly the blocks an OrderedDict LRU would (its recency runs evict
    in the same order), and neither its block owners nor the holders are tracked by the GC."""
    import hashlib
    from collections import OrderedDict

    from kvrouter.router.kv_index_shadow import ShadowKVIndex

    def chained(labels: list[int]) -> list[int]:  # prompt blocks: each names its whole prefix
        out, h = [], hashlib.blake2b(digest_size=8)
        for label in labels:
            h.update(bytes([label]))
            out.append(int.from_bytes(h.copy().digest(), "big"))
        return out

    rng = random.Random(5)
    idx = ShadowKVIndex(64)
    reference: dict[str, OrderedDict[int, None]] = {}
    capacity = {f"r{i}": rng.randrange(3, 40) for i in range(4)}
    for replica, blocks in capacity.items():
        idx.set_capacity(replica, blocks * 64)
    seen: set[int] = set()
    for _ in range(2000):
        replica = rng.choice(list(capacity))
        blocks = chained([rng.randrange(3) for _ in range(rng.randrange(1, 12))])
        seen.update(blocks)
        idx.record(replica, blocks)
        lru = reference.setdefault(replica, OrderedDict())
        for block in reversed(blocks):
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
        while len(lru) > capacity[replica]:
            lru.popitem(last=False)
        assert set(idx.held_blocks(replica)) == set(lru)
    for block in seen:
        holders = idx._holders.replicas(idx._holders.mask(block))
        assert sorted(holders) == sorted(r for r, lru in reference.items() if block in lru)
    gc.collect()
    assert not any(gc.is_tracked(state.owner) for state in idx._replicas.values())
    assert not gc.is_tracked(idx._holders._masks)


def test_long_chains_with_many_breakpoints_match_like_the_sets():
    """Prompts of thousands of blocks, replicas holding prefixes of every depth (some sharing a
    depth, some holding stray deeper blocks): the same matches, in the same order, at every
    limit (the bisection walks long runs of halvings between breakpoints)."""
    rng = random.Random(3)
    for _ in range(40):
        length = rng.randrange(1, 3000)
        blocks = list(range(length))
        bits, sets = BlockHolders(), {}
        for r in range(rng.randrange(1, 12)):
            depth = rng.choice([length, length - 1, rng.randrange(1, length + 1)])
            held = blocks[:depth] + rng.sample(blocks, min(length, rng.randrange(0, 3)))
            for block in held:
                bits.add(block, f"r{r}")
                sets.setdefault(block, set()).add(f"r{r}")
        for limit in (None, 1, 2, 5):
            query = blocks[:rng.randrange(1, length + 1)] if rng.random() < 0.3 else blocks
            got = match_prefix(bits, query, limit, 64)
            assert list(got.items()) == list(match_with_sets(sets, query, limit, 64).items())
