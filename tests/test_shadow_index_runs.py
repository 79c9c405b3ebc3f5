"""The shadow KV index stamps a prompt that extends one it recorded as a whole: it must hold the
same blocks, evict the same ones and match the same as a plain per-block LRU (the reference
below: every block of a record moved to the most recent end, leaf first), at the cost of the new
blocks only."""

from __future__ import annotations

import copy
import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.router.kv_index_shadow import ShadowKVIndex

BLOCK_TOKENS = 64


class ReferenceLRU:
    """Per-replica LRU of blocks; a record touches its blocks leaf first (root most recent)."""

    def __init__(self, default_blocks: int) -> None:
        self.default_blocks = default_blocks
        self.lru: dict[str, dict[int, None]] = {}
        self.capacity: dict[str, int] = {}

    def record(self, replica: str, blocks: list[int]) -> None:
        lru = self.lru.setdefault(replica, {})
        for block in reversed(blocks):
            lru.pop(block, None)
            lru[block] = None
        self.evict(replica)

    def set_capacity(self, replica: str, blocks: int) -> None:
        self.capacity[replica] = blocks
        self.evict(replica)

    def evict(self, replica: str) -> None:
        lru = self.lru.get(replica, {})
        while len(lru) > self.capacity.get(replica, self.default_blocks):
            del lru[next(iter(lru))]

    def forget(self, replica: str) -> None:
        self.lru.pop(replica, None)

    def match(self, blocks: list[int]) -> dict[str, int]:
        out = {}
        for replica, lru in self.lru.items():
            depth = 0
            while depth < len(blocks) and blocks[depth] in lru:
                depth += 1
            if depth:
                out[replica] = depth * BLOCK_TOKENS
        return out


def chain(labels: list[int]) -> list[int]:
    """Chained block ids: a block names its whole prefix, as prompt block hashes do."""
    out, h = [], hashlib.blake2b(digest_size=8)
    for label in labels:
        h.update(bytes([label]))
        out.append(int.from_bytes(h.copy().digest(), "big", signed=True))
    return out


# A small alphabet makes conversations share prefixes of every length (system prompts, forks).
labels = st.lists(st.integers(0, 2), min_size=1, max_size=24)
replicas = st.sampled_from(["r0", "r1", "r2"])
conversation = st.integers(0, 3)
operation = st.one_of(
    # the conversation's next turn: its prompt so far plus a few blocks (maybe none: a retry)
    st.tuples(st.just("turn"), replicas, conversation, st.lists(st.integers(0, 2), max_size=6)),
    # an earlier, shorter prompt of it again (a rewound or forked conversation)
    st.tuples(st.just("cut"), replicas, conversation, st.integers(1, 30)),
    st.tuples(st.just("capacity"), replicas, st.integers(1, 40), st.none()),
    st.tuples(st.just("forget"), replicas, st.none(), st.none()),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(labels, min_size=4, max_size=4), st.lists(operation, max_size=60), labels)
def test_runs_hold_evict_and_match_like_a_per_block_lru(starts, ops, query):
    index = ShadowKVIndex(BLOCK_TOKENS, default_capacity_tokens=30 * BLOCK_TOKENS)
    reference = ReferenceLRU(default_blocks=30)
    conversations = [list(start) for start in starts]
    for kind, replica, arg, more in ops:
        if kind in ("turn", "cut"):
            if kind == "turn":
                conversations[arg] += more
                prompt = conversations[arg]
            else:
                prompt = conversations[arg][:more]
            index.record(replica, chain(prompt))
            reference.record(replica, chain(prompt))
        elif kind == "capacity":
            index.set_capacity(replica, arg * BLOCK_TOKENS)
            reference.set_capacity(replica, arg)
        else:
            index.forget(replica)
            reference.forget(replica)
        for name in ("r0", "r1", "r2"):
            assert set(index.held_blocks(name)) == set(reference.lru.get(name, ()))
            assert index.cached_tokens(name) == len(reference.lru.get(name, ())) * BLOCK_TOKENS
        for prompt in [query, *conversations]:
            assert index.match(chain(prompt)) == reference.match(chain(prompt))
    for name in ("r0", "r1", "r2"):
        assert_same_eviction_order(index, reference, name)


def assert_same_eviction_order(index: ShadowKVIndex, reference: ReferenceLRU, replica: str) -> None:
    """Shrinking the replica's capacity one block at a time evicts the same block each time:
    the two hold their blocks in the same recency order."""
    index, reference = copy.deepcopy(index), copy.deepcopy(reference)
    for blocks in range(len(reference.lru.get(replica, ())) - 1, 0, -1):
        index.set_capacity(replica, blocks * BLOCK_TOKENS)
        reference.set_capacity(replica, blocks)
        assert set(index.held_blocks(replica)) == set(reference.lru[replica])


def test_an_extended_prompt_costs_its_new_blocks_only():
    index = ShadowKVIndex(BLOCK_TOKENS, default_capacity_tokens=10_000 * BLOCK_TOKENS)
    system = chain([0] * 20)
    conversations = [system + chain([0] * 20 + [1 + c] * 1500)[20:] for c in range(2)]
    for conversation in conversations:
        index.record("r", conversation)
    touched: list[int] = []
    take, take_new = index._take, index._take_new
    index._take = lambda state, replica, run, block, i: (touched.append(i), take(state, replica, run, block, i))
    index._take_new = lambda state, replica, run, start: (
        touched.extend(range(start, len(run.chain))), take_new(state, replica, run, start))
    longer = conversations[0] + chain([0] * 20 + [1] * 1505)[1520:]
    assert len(longer) == 1525
    index.record("r", longer)
    # the 5 new blocks, and the 20 system-prompt blocks the other conversation touched since
    assert sorted(touched) == list(range(20)) + list(range(1520, 1525))
    assert index.match(longer) == {"r": 1525 * BLOCK_TOKENS}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(replicas, st.lists(st.integers(0, 12), max_size=30), st.integers(1, 40)),
                max_size=40))
def test_books_balance_with_repeated_and_shared_hashes(ops):
    """Chains that repeat a hash or share blocks anywhere (not chained: a collision, or a
    caller's own ids): the blocks taken and evicted in one pass keep every count in step."""
    index = ShadowKVIndex(BLOCK_TOKENS, default_capacity_tokens=20 * BLOCK_TOKENS)
    for replica, blocks, capacity in ops:
        index.record(replica, blocks)
        if capacity % 7 == 0:
            index.set_capacity(replica, capacity * BLOCK_TOKENS)
        for name in ("r0", "r1", "r2"):
            state = index._replicas.get(name)
            owner = state.owner if state is not None else {}
            held = {b for b, mask in index._holders._masks.items()
                    if name in index._holders.replicas(mask)}
            assert held == set(owner)
            assert index._holders._held.get(name, 0) == len(owner)
            if state is not None:
                assert sum(run.held for run in state.runs.values()) == len(owner)
                assert all(run.held > 0 for run in state.runs.values())
                assert all(state.runs[rid].chain[:state.runs[rid].top].count(b)
                           for b, rid in owner.items())
                assert len(owner) <= index._capacity_blocks.get(name, 20)
