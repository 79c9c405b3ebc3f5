"""The run-compressed radix cache against the plain per-page model (tests/radix_page_reference.py).

Random request lifecycles (match, lock, load back, chunk inserts, finish, abort, evictions with a
protected load-back, flushes) on paths that share prefixes, with frequent equal timestamps: both
caches must return the same matches and counts, publish the same KV events in the same order
(which is the eviction order) and hold every page in the same tier.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouter.loadtest.radix_cache import DEVICE, RadixCache, page_keys
from tests import radix_page_reference as reference

PS = 2


class Log:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def stored(self, pages, medium):
        self.events.append(("stored", medium, [(k, p, None if t is None else list(t)) for k, p, t in pages]))

    def removed(self, keys, medium):
        self.events.append(("removed", medium, list(keys)))

    def cleared(self):
        self.events.append(("cleared",))


def tiers_of_runs(cache: RadixCache) -> dict[int, int]:
    return {k: run.tier for run in cache._all_runs() for k in run.keys}


def tiers_of_pages(cache: reference.RadixCache) -> dict[int, int]:
    return {k: node.tier for k, node in cache._nodes.items()}


class Pair:
    """Both caches, fed the same calls; every call's result and events are compared."""

    def __init__(self, dev_pages: int, host_pages: int, write_through: bool) -> None:
        self.new_log, self.ref_log = Log(), Log()
        self.new = RadixCache(PS, dev_pages * PS, host_pages * PS, self.new_log, write_through=write_through)
        self.ref = reference.RadixCache(PS, dev_pages * PS, host_pages * PS, self.ref_log, write_through=write_through)

    def call(self, name: str, *args, **kwargs):
        got = getattr(self.new, name)(*args, **kwargs)
        want = getattr(self.ref, name)(*args, **kwargs)
        assert got == want, name
        assert self.new_log.events == self.ref_log.events, name
        for attr in ("dev_pages", "host_pages", "locked_pages", "evicted_pages_total"):
            assert getattr(self.new, attr) == getattr(self.ref, attr), attr
        return got

    def check(self) -> None:
        assert tiers_of_runs(self.new) == tiers_of_pages(self.ref)
        assert len(self.new) == len(self.ref)
        self.new.check_invariants()
        self.ref.check_invariants()


def make_paths(symbols: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """(tokens, page keys) per path; pages are drawn from few values so prefixes are shared."""
    paths = []
    for syms in symbols:
        tokens = [v for s in syms for v in (s, s + 7)]  # one page per symbol
        paths.append((tokens, page_keys(tokens, PS, "m")))
    return paths


OPS = st.lists(
    st.tuples(
        st.sampled_from(["request", "request", "chunk", "finish", "finish", "abort", "evict", "evict", "match", "flush"]),
        st.integers(0, 63),
        st.integers(0, 40),
        st.sampled_from([0, 0, 0, 1, 2]),  # time step: 0 makes ties, which order by page key
    ),
    max_size=70,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    symbols=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=6),
    dev_pages=st.integers(4, 30),
    host_pages=st.sampled_from([0, 0, 6, 20, 60]),
    write_through=st.booleans(),
    ops=OPS,
)
def test_runs_behave_exactly_like_per_page_nodes(symbols, dev_pages, host_pages, write_through, ops):
    pair = Pair(dev_pages, host_pages, write_through)
    paths = make_paths(symbols)
    held: list[list] = []  # [path index, pages locked in the tree, pages wanted]
    now = 0.0
    for op, a, b, step in ops:
        now += step
        if op == "request":
            i = a % len(paths)
            tokens, keys = paths[i]
            cap = min(len(keys), 1 + b % len(keys))
            dev, host = pair.call("match", keys, cap, now)
            pair.call("lock", keys, 0, dev)
            if host:  # load back, making room on the device first
                room = pair.ref.device_capacity_pages - pair.ref.dev_pages
                if room < host:
                    pair.call("evict", (host - room) * PS, keys[dev : dev + host])
                pair.call("insert", keys, dev, dev + host, now, lock=True, token_ids=tokens)
            held.append([i, dev + host, len(keys)])
        elif op in ("chunk", "finish") and held:
            h = held[a % len(held)]
            tokens, keys = paths[h[0]]
            end = min(h[2], h[1] + 1 + b % 6) if op == "chunk" else h[2]
            room = pair.ref.device_capacity_pages - pair.ref.dev_pages
            if end - h[1] > room:
                pair.call("evict", (end - h[1] - room) * PS)
            pair.call("insert", keys, h[1], end, now, lock=op == "chunk", token_ids=tokens)
            if op == "chunk":
                h[1] = max(h[1], end)
            else:
                pair.call("unlock", keys, 0, h[1])
                held.remove(h)
        elif op == "abort" and held:
            h = held.pop(a % len(held))
            pair.call("unlock", paths[h[0]][1], 0, h[1])
        elif op == "evict":
            pair.call("evict", b * PS)
        elif op == "match":
            keys = paths[a % len(paths)][1]
            pair.call("match", keys, b, now)
        elif op == "flush" and not held:
            pair.call("flush")
        pair.check()
    for h in held:
        pair.call("unlock", paths[h[0]][1], 0, h[1])
    pair.call("evict", 10**6 * PS)
    pair.check()
    assert pair.new.locked_pages == 0


def test_a_long_context_is_a_few_runs_not_one_node_per_page():
    keys = page_keys(list(range(100_000)), 64, "m")
    cache = RadixCache(64, 450_000)
    cache.insert(keys, 0, 800, 0.0, lock=True)  # a first chunk
    cache.insert(keys, 800, len(keys), 1.0, lock=True)
    cache.unlock(keys, 0, len(keys))
    assert cache.match(keys, 1000, 2.0) == (1000, 0)  # a shorter request splits a run there
    assert cache._runs == 3 and len(cache) == len(keys) == 1562
    assert cache.evict(562 * 64) == 562 * 64  # the tail run leaves first, pages last-first
    assert cache.match(keys, len(keys), 3.0) == (1000, 0)
    assert {cache.tier_of(k) for k in keys[:1000]} == {DEVICE}
    cache.check_invariants()
