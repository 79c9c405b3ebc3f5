"""An approximate, capacity-aware shadow of which prefix blocks each replica holds.

Recorded when a replica accepts a request (it answered with a status the router does not retry,
so it will cache the prompt; a refused or unreachable attempt records nothing), bounded per replica
by that replica's KV capacity (max_total_num_tokens, else a capacity learnt from its reported cache
hits, else the default) in blocks, LRU. A block is a fixed number of characters; its size in tokens
is per replica (4 characters per token until calibrated, router/learning.py). Blocks are touched leaf-first so a prefix's
root is always more recent than its tail: eviction trims conversations from the end, as SGLang's
radix cache evicts leaves, and a surviving root never points at an evicted middle.
A record costs the blocks it adds, not the prompt: the blocks one record touched keep their
recency as one run, and the next turn of the conversation re-stamps that run whole (the same
order, evictions and matches as touching every block; blocks are chained hashes, so a block sits
at one position in every prompt holding it).
An engine that touches a prompt's pages root first (a plain LRU of pages, not a radix cache)
evicts a conversation from its root instead, and with the root goes every match past it: a
replica learnt to do that (router/learning.py, `set_root_first`) loses its least recent run
whole.
Synchronous and lock-free: the event loop is the only writer.
"""

from __future__ import annotations

from collections.abc import KeysView, Sequence
from itertools import compress, count, islice, repeat

from ..policies.cost import DEFAULT_CAPACITY_TOKENS
from .block_holders import BlockHolders, match_prefix


class _Run:
    """The blocks one record stamped most recent, as one LRU entry: `chain[i]` for each i below
    `top` that it still owns. Within a run the deeper block is the older (touched leaf first);
    a later record of a prompt that extends the chain re-stamps the whole run instead of every
    block. `lost`: positions below `top` other records took (or may have) since. `trimmed`:
    eviction took blocks from its end since it was last recorded."""

    __slots__ = ("rid", "chain", "top", "held", "lost", "trimmed")

    def __init__(self, rid: int, chain: tuple[int, ...]) -> None:
        self.rid = rid
        self.chain = chain
        self.top = 0
        self.held = 0
        self.lost: set[int] = set()
        self.trimmed = False


class _ReplicaBlocks:
    """One replica's blocks: which run last recorded each (`owner`: ints only, so the garbage
    collector never walks it) and the runs, least recently recorded first."""

    __slots__ = ("owner", "runs")

    def __init__(self) -> None:
        self.owner: dict[int, int] = {}
        self.runs: dict[int, _Run] = {}

    def last_held(self, chain: Sequence[int]) -> int:
        """The position of the deepest block of `chain` (not empty) this replica holds; -1: none."""
        owner = self.owner
        if chain[-1] in owner:
            return len(chain) - 1
        if chain[0] not in owner:
            return -1
        lo, hi = 0, len(chain) - 1  # blocks are held prefix-closed: bisect for the last held one
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if chain[mid] in owner:
                lo = mid
            else:
                hi = mid
        return lo

    def extendable(self, chain: tuple[int, ...]) -> _Run | None:
        """The run holding the deepest block of `chain` this replica holds, if `chain` extends
        (or equals) everything that run covers."""
        last = self.last_held(chain)
        if last < 0:
            return None
        run = self.runs[self.owner[chain[last]]]
        top, held = run.top, run.chain
        if top > len(chain):
            return None
        # (a run usually covers its whole chain: then that is compared, not a copy of it)
        if (held if top == len(held) else held[:top]) != (chain if top == len(chain) else chain[:top]):
            return None
        return run


class ShadowKVIndex:
    def __init__(self, block_tokens: int = 64, default_capacity_tokens: int = DEFAULT_CAPACITY_TOKENS) -> None:
        self.block_tokens = block_tokens
        self.default_capacity_tokens = default_capacity_tokens
        self._holders = BlockHolders()
        self._replicas: dict[str, _ReplicaBlocks] = {}
        self._run_ids = count()
        self._capacity_blocks: dict[str, int] = {}
        self._reported_tokens: dict[str, int] = {}  # max_total_num_tokens, as the replica reports it
        self._learned_tokens: dict[str, int] = {}  # else its effective capacity, learnt
        self._replica_block_tokens: dict[str, float] = {}  # calibrated; else `block_tokens`
        self.learnt_below_reported = False  # a learnt capacity lower than the reported one wins
        self._root_first: set[str] = set()  # replicas whose engine evicts a conversation from its root

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
        """The replica holds `blocks` now, root most recent. A prompt that extends one this replica
        recorded before costs its new blocks (and any the prompt shares with others recorded
        since), not all of them: the earlier run is stamped most recent as a whole."""
        state = self._replicas.get(replica)
        if state is None:
            state = self._replicas[replica] = _ReplicaBlocks()
        count = len(blocks)
        if count:
            chain = blocks if isinstance(blocks, tuple) else tuple(blocks)
            run = state.extendable(chain)
            if run is None:
                run = _Run(next(self._run_ids), chain)
                state.runs[run.rid] = run
            else:
                state.runs[run.rid] = state.runs.pop(run.rid)  # now the most recent run
            old_top = run.top
            lost = sorted((i for i in run.lost if i < old_top), reverse=True)
            run.chain, run.top, run.lost, run.trimmed = chain, count, set(), False
            self._take_new(state, replica, run, old_top)
            take = self._take
            for i in lost:  # its blocks other prompts touched since: this one is newer
                take(state, replica, run, chain[i], i)
        self._evict(replica)

    def _take_new(self, state: _ReplicaBlocks, replica: str, run: _Run, start: int) -> None:
        """`_take` of `run.chain[start:]`, leaf first. The blocks no run holds (most of them, a
        whole prompt's after its conversation was evicted) are taken in one pass: nothing else
        changes with them, so their order does not matter; those other runs hold go one by one."""
        owner, rid = state.owner, run.rid
        new = run.chain[start:]
        if not owner.keys().isdisjoint(new):
            held = list(map(owner.__contains__, new))
            take = self._take
            for i in range(len(new) - 1, -1, -1):  # leaf first, as SGLang touches them
                if held[i]:
                    take(state, replica, run, new[i], start + i)
            new = [block for block, taken in zip(new, held) if not taken]
        before = len(owner)
        owner.update(zip(new, repeat(rid)))
        run.held += len(owner) - before  # a hash twice in the chain is held once
        self._holders.add_many(new, replica)

    def _take(self, state: _ReplicaBlocks, replica: str, run: _Run, block: int, index: int) -> None:
        """`block`, at `index` of `run`'s chain, is now recorded by `run`."""
        owner = state.owner
        current = owner.get(block)
        if current is None:
            self._holders.add(block, replica)
        elif current == run.rid:
            return  # a duplicate hash later in the same chain; the earlier position stands
        else:
            other = state.runs[current]
            other.held -= 1
            if other.held:
                other.lost.add(index)  # chains agree on every block's position
            else:
                del state.runs[current]
        owner[block] = run.rid
        run.held += 1

    def _evict(self, replica: str) -> None:
        state = self._replicas.get(replica)
        if state is None:
            return
        excess = len(state.owner) - self._limit_blocks(replica)
        whole = replica in self._root_first
        owner, runs, discard_many = state.owner, state.runs, self._holders.discard_many
        while excess > 0:  # the least recent run, its deepest blocks first
            run = next(iter(runs.values()))
            chain, rid, top = run.chain, run.rid, run.top
            # Root first: the engine's next victim is the run's root, which takes every match
            # past it; the rest of its blocks are the victims after that, unmatched till then.
            want = run.held if whole else excess
            excess -= want
            while want > 0 and top > 0 and run.held > 0:
                # The next `want` positions up from the deepest left: the run's own blocks
                # among them all go (fewer than `want` if others took some: then on down).
                low = max(0, top - want)
                below = chain[low:top]
                owners = list(map(owner.pop, below, repeat(None)))  # a repeated hash: None the 2nd time
                if owners.count(rid) == len(below):  # all the run's: no Python loop
                    gone = below
                else:  # others' go back
                    owner.update({b: o for b, o in zip(below, owners) if o is not None and o != rid})
                    gone = [b for b, o in zip(below, owners) if o == rid]
                discard_many(gone, replica)
                run.held -= len(gone)
                want -= len(gone)
                top = low
            excess += want  # what the run could not give (others held it) comes from the next
            run.top = top
            run.trimmed = True
            if run.held <= 0:
                del runs[rid]
            elif run.top < len(chain) // 2:
                run.chain = chain[: run.top]  # let the evicted tail's hashes go

    def set_root_first(self, replica: str, root_first: bool = True) -> None:
        """Whether the replica's engine evicts a conversation from its root (a plain LRU of
        pages touched root first) rather than from its end. Turned on, the runs already trimmed
        are dropped: their roots went first, so nothing of them matches."""
        if not root_first:
            self._root_first.discard(replica)
            return
        self._root_first.add(replica)
        state = self._replicas.get(replica)
        if state is None:
            return
        for run in [r for r in state.runs.values() if r.trimmed]:
            self._drop_run(state, replica, run)

    def root_first(self, replica: str) -> bool:
        return replica in self._root_first

    def fill(self, replica: str) -> float:
        """The share of the replica's capacity the index holds blocks in."""
        state = self._replicas.get(replica)
        if state is None:
            return 0.0
        return len(state.owner) / max(1, self._limit_blocks(replica))

    def _limit_blocks(self, replica: str) -> int:
        """The blocks the index keeps for the replica (its capacity, until resized the default)."""
        return self._capacity_blocks.get(replica, self.default_capacity_tokens // self.block_tokens)

    def _drop_run(self, state: _ReplicaBlocks, replica: str, run: _Run) -> None:
        owner, rid = state.owner, run.rid
        gone = [b for b in dict.fromkeys(run.chain[: run.top]) if owner.get(b) == rid]  # a hash twice: once
        for block in gone:
            del owner[block]
        self._holders.discard_many(gone, replica)
        del state.runs[rid]

    def match_split(self, replica: str, chain: Sequence[int]) -> tuple[int, int, bool] | None:
        """The index's match of `chain` on `replica` in two: (blocks matched, blocks of them
        that runs other than the one the match ends in hold, such as a shared system prompt,
        and whether eviction trimmed that run from its end). An engine that evicts a
        conversation from its root keeps only the others' blocks of it once it evicted any; one
        that evicts from the end keeps its first blocks: a reported hit short of the match tells
        the two orders apart (router/learning.py). None: no match."""
        state = self._replicas.get(replica)
        if state is None or not chain:
            return None
        last = state.last_held(chain)
        if last < 0:
            return None
        owner = state.owner
        rid = owner[chain[last]]
        matched = last + 1
        # the first matched block the run holds, found in C (asked of most accepted requests)
        runs_of = map(owner.__getitem__, islice(chain, matched))
        others = next(compress(count(), map(rid.__eq__, runs_of)), matched)
        return matched, others, state.runs[rid].trimmed

    def forget(self, replica: str) -> None:
        """Drop a replica entirely (removed, flushed)."""
        self._root_first.discard(replica)
        state = self._replicas.pop(replica, None)
        if state is not None:
            for block in state.owner:
                self._holders.discard(block, replica)

    def held_blocks(self, replica: str) -> KeysView[int]:
        """The blocks the replica is taken to hold (a live view)."""
        state = self._replicas.get(replica)
        return (state.owner if state is not None else {}).keys()

    def cached_tokens(self, replica: str) -> int:
        state = self._replicas.get(replica)
        return int((len(state.owner) if state is not None else 0) * self.block_tokens_of(replica))
