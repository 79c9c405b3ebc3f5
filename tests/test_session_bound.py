"""The session table is bounded: least recently used idle sessions are evicted, busy ones never."""

from __future__ import annotations

from collections import OrderedDict

import aiohttp
import pytest

from kvrouter.router.affinity import MemoryAffinityStore
from kvrouter.router.sessions import _EVICT_STEPS, SessionTable

from .fakes import FakeUpstream


def table(max_sessions: int) -> tuple[SessionTable, list[str], list[int]]:
    changed: list[str] = []
    evictions: list[int] = []
    t = SessionTable(on_home_change=changed.append, max_sessions=max_sessions, on_evict=evictions.append)
    return t, changed, evictions


def test_the_least_recently_used_session_is_evicted_and_its_replica_totals_drop():
    t, changed, evictions = table(3)
    for i, key in enumerate(["a", "b", "c"]):
        t.assign(key, "http://r1" if key != "c" else "http://r2", force=False, tokens=100, now=i)
    t.touch("a", 3.0)  # "a" used again: "b" is now the least recently used
    assert t.homed_sessions == {"http://r1": 2, "http://r2": 1}
    changed.clear()
    t.assign("d", "http://r2", force=False, tokens=50, now=4)
    assert len(t) == 3 and t.entry("b") is None and t.entry("a") is not None
    assert t.homed_sessions == {"http://r1": 1, "http://r2": 2}
    assert t.homed_tokens == {"http://r1": 100, "http://r2": 150}
    assert "http://r1" in changed  # the engine hears of the drop
    assert evictions == [1] and t.evicted == 1


def test_a_release_counts_as_a_use():
    t, _, _ = table(2)
    t.acquire("a", 0.0)
    t.acquire("b", 1.0)
    t.release("b", 2.0)
    t.release("a", 3.0)  # "a" finished last: "b" is the older one now
    t.acquire("c", 4.0)
    assert t.entry("b") is None and t.entry("a") is not None


def test_a_session_with_a_request_in_flight_is_never_evicted():
    t, _, evictions = table(2)
    t.acquire("busy", 0.0)  # oldest, but in flight
    t.acquire("idle", 1.0)
    t.release("idle", 1.5)
    t.acquire("new", 2.0)
    assert t.entry("busy") is not None and t.entry("idle") is None and len(t) == 2
    # Every session busy: the cap is exceeded rather than a request's session dropped ...
    t.acquire("more", 3.0)
    assert len(t) == 3 and evictions == [1]
    # ... until sessions are idle again; the next insert brings the table back under the cap.
    for key in ("busy", "new", "more"):
        t.release(key, 4.0)
    t.acquire("last", 5.0)
    assert len(t) == 2 and set(t._entries) == {"more", "last"}


def test_making_room_looks_at_a_bounded_number_of_entries():
    """The per-request cost stays constant when many sessions at the front are busy: an insert
    looks at a few entries (moving busy ones to the back), not the whole table."""
    t, _, _ = table(1000)
    for i in range(1000):
        t.acquire(f"busy{i}", float(i))

    class Counted(OrderedDict):
        moves = 0

        def move_to_end(self, key, last=True):
            Counted.moves += 1
            super().move_to_end(key, last)

    t._entries = Counted(t._entries)
    t.acquire("new", 2000.0)
    assert 1 <= Counted.moves <= _EVICT_STEPS and len(t) == 1001


def test_many_invented_session_ids_stay_within_the_cap():
    t, _, _ = table(100)
    for i in range(10_000):
        t.assign(f"s{i}", f"http://r{i % 3}", force=False, tokens=10, now=float(i))
    assert len(t) == 100 and t.evicted == 9_900
    assert sum(t.homed_sessions.values()) == 100
    assert sum(t.homed_tokens.values()) == 1000


async def test_memory_store_bounds_and_counts_evictions():
    t, _, _ = table(2)
    store = MemoryAffinityStore(t, clock=lambda: 0.0)
    for key in ("a", "b", "c", "d"):
        await store.acquire(key)
        await store.begin(key, "http://r1", force=False, tokens=1)
        await store.end(key)
    assert len(t) == 2 and t.evicted == 2
    assert (await store.get("a")).home is None and (await store.get("d")).home == "http://r1"


async def test_router_reports_evictions_in_its_metrics(start_app, start_router):
    replica = await start_app(FakeUpstream().app())
    router, url = await start_router([replica], affinity={"max_sessions": 2},
                                     signals={"source": "health", "interval_s": 60})
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        for i in range(5):
            async with http.post(f"{url}/v1/chat/completions", json=body,
                                 headers={"x-session-id": f"s{i}"}) as resp:
                assert resp.status == 200
                await resp.read()
    assert len(router.table) == 2
    assert router.metrics.registry.get_sample_value(
        "kvrouter_sessions_evicted_total", {"store": "memory"}) == 3


def test_max_sessions_must_be_positive():
    with pytest.raises(ValueError):
        SessionTable(max_sessions=0)


def test_expire_walks_from_the_oldest_and_skips_requests_in_flight():
    """Expiry stops at the first session used within the TTL (the table is in order of use),
    still expiring every idle one past it and never one with a request in flight."""
    t = SessionTable(ttl_s=10.0)
    for i in range(5):
        t.touch(f"s{i}", float(i))
    t.acquire("s1", 1.0)  # in flight since t=1: old, busy
    t.touch("s3", 20.0)  # used again: moves to the end
    assert t.expire(14.5) == 3  # s0, s2, s4 (idle, last used at 0, 2, 4); s1 busy; s3 recent
    assert {k for k in ("s0", "s1", "s2", "s3", "s4") if t.entry(k) is not None} == {"s1", "s3"}
    t.release("s1", 21.0)  # the clock only moves forward, so use order is time order
    assert t.expire(30.5) == 1 and t.entry("s3") is None and t.entry("s1") is not None
