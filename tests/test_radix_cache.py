import time

import pytest

from kvrouter.loadtest.radix_cache import (
    DEVICE,
    HOST,
    MEDIUM_CPU,
    MEDIUM_GPU,
    RadixCache,
    chain_keys,
    page_keys,
    root_key,
)

PS = 4


class Sink:
    def __init__(self):
        self.log = []

    def stored(self, pages, medium):
        self.log.append(("stored", medium, list(pages)))

    def removed(self, keys, medium):
        self.log.append(("removed", medium, list(keys)))

    def cleared(self):
        self.log.append(("cleared",))


def seq(start, n):
    return list(range(start, start + n))


def put(cache, keys, now, lock=False):
    return cache.insert(keys, 0, len(keys), now, lock=lock)


# ---- keys ----------------------------------------------------------------------------------------
def test_page_keys_are_chained_deterministic_and_whole_pages_only():
    toks = seq(0, 10)
    keys = page_keys(toks, PS, "m")
    assert len(keys) == 2  # the partial third page has no key
    assert keys == page_keys(toks, PS, "m")
    assert page_keys(toks[:8] + [99, 98, 97, 96], PS, "m")[:2] == keys  # same prefix, same keys
    assert page_keys([7] + toks[1:], PS, "m")[1] != keys[1]  # a key encodes its whole prefix
    assert chain_keys(keys[0], toks, PS, start_page=1) == keys[1:]
    assert all(0 <= k < 2**64 for k in keys)
    # fixed value: blake2b, never Python's salted hash()
    assert root_key("m") == root_key("m") and root_key("m") != root_key("m2")


def test_namespaces_never_share_pages():
    toks = seq(0, 16)
    a, b = page_keys(toks, PS, "model|salt=a"), page_keys(toks, PS, "model|salt=b")
    assert not set(a) & set(b)
    cache = RadixCache(PS, 1000)
    put(cache, a, 1.0)
    assert cache.match(b, 4, 2.0) == (0, 0)
    assert cache.match(a, 4, 2.0) == (4, 0)


# ---- match / insert ------------------------------------------------------------------------------
def test_match_is_whole_pages_and_capped():
    keys = page_keys(seq(0, 40), PS)
    cache = RadixCache(PS, 1000)
    put(cache, keys[:6], 1.0)
    assert cache.match(keys, len(keys), 2.0) == (6, 0)
    assert cache.match(keys, 3, 2.0) == (3, 0)
    other = page_keys(seq(0, 12) + seq(500, 20), PS)
    assert cache.match(other, len(other), 2.0) == (3, 0)  # diverges inside page 4
    assert cache.device_tokens == 6 * PS


def test_insert_counts_only_new_pages_and_extends_a_branch():
    keys = page_keys(seq(0, 40), PS)
    cache = RadixCache(PS, 1000)
    assert put(cache, keys[:4], 1.0) == 4
    assert cache.insert(keys, 0, 6, 2.0) == 2
    branch = page_keys(seq(0, 8) + seq(900, 16), PS)
    assert cache.insert(branch, 0, len(branch), 3.0) == 4  # shares the first two pages
    assert len(cache) == 10


# ---- locks and eviction -----------------------------------------------------------------------
def test_lru_evicts_least_recently_used_leaves_first():
    a, b, c = (page_keys(seq(s, 8), PS) for s in (0, 100, 200))
    cache = RadixCache(PS, 1000)
    put(cache, a, 1.0)
    put(cache, b, 2.0)
    put(cache, c, 3.0)
    cache.match(a, 2, 4.0)  # a becomes the most recent
    assert cache.evict(2 * PS) == 2 * PS
    assert b[0] not in cache and a[0] in cache and c[0] in cache
    assert cache.evict(1) == PS  # whole pages; the leaf of c goes before its parent
    assert c[0] in cache and c[1] not in cache


def test_inner_pages_go_only_after_their_children():
    shared = seq(0, 8)
    x = page_keys(shared + seq(100, 4), PS)
    y = page_keys(shared + seq(200, 4), PS)
    cache = RadixCache(PS, 1000)
    put(cache, x, 1.0)
    put(cache, y, 5.0)
    cache.evict(PS)  # x's leaf (t=1)
    assert x[2] not in cache and x[1] in cache
    cache.evict(PS)  # the shared parent is not a leaf yet (y's leaf hangs on it): y's leaf goes
    assert y[2] not in cache and x[1] in cache
    cache.evict(PS)
    assert x[1] not in cache and x[0] in cache


def test_locked_pages_are_never_evicted_and_counters_follow():
    run, idle = page_keys(seq(0, 16), PS), page_keys(seq(100, 16), PS)
    cache = RadixCache(PS, 1000)
    put(cache, run, 1.0, lock=True)
    put(cache, idle, 2.0)
    assert cache.locked_tokens == 16 and cache.evictable_tokens == 16
    assert cache.evict(1000) == 16  # only the unlocked prefix can go
    assert all(k in cache for k in run) and not any(k in cache for k in idle)
    cache.unlock(run, 0, 4)
    assert cache.locked_tokens == 0 and cache.evictable_tokens == 16
    assert cache.evict(1000) == 16 and len(cache) == 0


def test_lock_is_counted_once_per_page_when_shared():
    keys = page_keys(seq(0, 16), PS)
    cache = RadixCache(PS, 1000)
    put(cache, keys, 1.0)
    cache.lock(keys, 0, 4)
    cache.lock(keys, 0, 2)
    assert cache.locked_tokens == 16
    cache.unlock(keys, 0, 4)
    assert cache.locked_tokens == 8 and cache.evict(1000) == 8
    cache.unlock(keys, 0, 2)
    assert cache.evictable_tokens == 8


# ---- host tier (HiCache) -------------------------------------------------------------------------
def test_device_eviction_moves_to_host_and_match_walks_device_then_host():
    keys = page_keys(seq(0, 24), PS)
    sink = Sink()
    cache = RadixCache(PS, 1000, host_capacity_tokens=100, sink=sink, write_through=False)
    put(cache, keys, 1.0)
    cache.evict(2 * PS)
    assert cache.tier_of(keys[5]) == HOST and cache.tier_of(keys[3]) == DEVICE
    assert cache.match(keys, 6, 2.0) == (4, 2)
    assert cache.host_tokens == 8 and cache.device_tokens == 16
    # loading back = inserting the host pages on the device again
    assert cache.insert(keys, 4, 6, 3.0, lock=True) == 2
    assert cache.match(keys, 6, 4.0) == (6, 0) and cache.host_tokens == 0
    media = [(e[0], e[1]) for e in sink.log]
    assert ("removed", MEDIUM_GPU) in media and ("stored", MEDIUM_CPU) in media
    assert ("removed", MEDIUM_CPU) in media


def test_full_host_evicts_its_own_lru_leaves():
    a, b = page_keys(seq(0, 8), PS), page_keys(seq(100, 8), PS)
    cache = RadixCache(PS, 1000, host_capacity_tokens=2 * PS, write_through=False)  # write_back
    put(cache, a, 1.0)
    put(cache, b, 2.0)
    cache.evict(2 * PS)  # a -> host (fills it)
    assert cache.match(a, 2, 3.0) == (0, 2)  # touching a on host at t=3
    # b's pages move to a full host: each move evicts the host LRU leaf. First a[1] (t=3) goes,
    # then b[1] (t=2) is older than a[0] (which inherited t=3 from its evicted child).
    cache.evict(2 * PS)
    assert cache.host_tokens == 2 * PS and cache.device_tokens == 0
    assert cache.tier_of(a[0]) == HOST and cache.tier_of(b[0]) == HOST
    assert a[1] not in cache and b[1] not in cache


def _fill_with_churn(cache, n_chains=30):
    peak = 0
    for t in range(n_chains):
        keys = page_keys(seq(1000 * t, 4 * PS), PS)
        dev, _ = cache.match(keys, len(keys), float(t))
        need = (len(keys) - dev) * PS - (cache.device_capacity_pages * PS - cache.device_tokens)
        if need > 0:
            cache.evict(need)
        cache.insert(keys, dev, len(keys), float(t))
        cache.check_invariants()
        peak = max(peak, len(cache))
    return peak


def test_write_through_host_pool_bounds_unique_pages():
    """write_through mirrors every device page on host: device + host-only <= the host pool."""
    wt = RadixCache(PS, 8 * PS, host_capacity_tokens=16 * PS)
    assert _fill_with_churn(wt) == 16 and wt.dev_pages + wt.host_pages <= 16
    assert wt.unique_capacity_tokens == 16 * PS
    # write_back takes a host slot only on eviction: device and host add up
    wb = RadixCache(PS, 8 * PS, host_capacity_tokens=16 * PS, write_through=False)
    assert _fill_with_churn(wb) == 24 and wb.unique_capacity_tokens == 24 * PS


def test_write_through_device_eviction_needs_no_host_room_and_load_back_keeps_it():
    wt = RadixCache(PS, 8 * PS, host_capacity_tokens=16 * PS)
    a = page_keys(seq(0, 8 * PS), PS)
    put(wt, a, 1.0)  # 8 device pages, 8 host slots mirror them
    assert wt.evict(8 * PS) == 8 * PS and wt.host_pages == 8 and wt.dev_pages == 0
    b = page_keys(seq(500, 8 * PS), PS)
    put(wt, b, 2.0)  # 8 new device pages take the 8 free host slots: nothing evicted from host
    assert wt.host_pages == 8 and len(wt) == 16
    wt.evict(4 * PS)  # b's tail moves to host without touching a
    assert wt.host_pages == 12 and all(k in wt for k in a)
    c = page_keys(seq(900, 2 * PS), PS)
    put(wt, c, 3.0)  # 2 new device pages: the host LRU (a's tail) gives up 2 host-only slots
    assert wt.dev_pages + wt.host_pages == 16 and a[-1] not in wt and a[-2] not in wt
    wt.check_invariants()


def test_events_carry_parent_chain_and_tokens():
    toks = seq(0, 12)
    keys = page_keys(toks, PS)
    sink = Sink()
    cache = RadixCache(PS, 1000, sink=sink)
    cache.insert(keys, 0, 3, 1.0, token_ids=toks)
    kind, medium, pages = sink.log[0]
    assert (kind, medium) == ("stored", "GPU")
    assert [p[0] for p in pages] == keys
    assert [p[1] for p in pages] == [None, keys[0], keys[1]]
    assert list(pages[2][2]) == toks[8:12]
    cache.flush()
    assert sink.log[-1] == ("cleared",) and len(cache) == 0


def test_a_sink_mirror_always_equals_the_cache_under_host_churn():
    mirror = {}

    class Mirror:
        def stored(self, pages, medium):
            for key, _, _ in pages:
                assert key not in mirror, "stored twice without a removal"
                mirror[key] = medium

        def removed(self, keys, medium):
            for key in keys:
                assert mirror.pop(key) == medium

        def cleared(self):
            mirror.clear()

    cache = RadixCache(PS, 1000, host_capacity_tokens=6 * PS, sink=Mirror(), write_through=False)
    chains = [page_keys(seq(100 * i, 4 * (2 + i % 3)), PS) for i in range(12)]
    for t, keys in enumerate(chains * 3):
        dev, host = cache.match(keys, len(keys), float(t))
        cache.insert(keys, dev, len(keys), float(t))  # loads host pages back, adds the rest
        cache.evict(3 * PS)
        expected = {k: (MEDIUM_GPU if cache.tier_of(k) == DEVICE else MEDIUM_CPU) for k in mirror}
        assert mirror == expected and len(mirror) == len(cache)
        cache.check_invariants()


def test_flush_refuses_while_locked():
    keys = page_keys(seq(0, 8), PS)
    cache = RadixCache(PS, 1000)
    put(cache, keys, 1.0, lock=True)
    with pytest.raises(RuntimeError):
        cache.flush()


def test_heap_stays_bounded_under_repeated_touches():
    keys = page_keys(seq(0, 64), PS)
    cache = RadixCache(PS, 10_000)
    put(cache, keys, 0.0)
    for i in range(20_000):
        cache.match(keys, 16, float(i))
    assert len(cache._dev_heap) <= 4 * len(cache) + 1024 + 1


# ---- micro-benchmark (reports, never asserts timings) --------------------------------------------
def test_benchmark_100k_prompt_match_insert_lock():
    ps = 64
    toks = seq(0, 100_000)
    t0 = time.perf_counter()
    keys = page_keys(toks, ps, "kimi")
    t_hash = time.perf_counter() - t0
    cache = RadixCache(ps, 450_000)
    t0 = time.perf_counter()
    cache.insert(keys, 0, len(keys), 0.0, lock=True)
    cache.unlock(keys, 0, len(keys))
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = 50
    for i in range(n):
        dev, host = cache.match(keys, len(keys), float(i))
        cache.lock(keys, 0, dev)
        cache.insert(keys, dev, len(keys), float(i), lock=True)
        cache.unlock(keys, 0, len(keys))
    t_warm = (time.perf_counter() - t0) / n
    assert dev == len(keys) == 1562
    print(
        f"\n1562 pages: hash {t_hash * 1e3:.2f} ms, cold insert {t_first * 1e3:.2f} ms, "
        f"warm match+lock+insert+unlock {t_warm * 1e3:.3f} ms"
    )
