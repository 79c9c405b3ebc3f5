"""RedisAffinityStore against a real Redis-protocol server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from kvrouter.router.affinity import RedisAffinityStore
from kvrouter.router.sessions import SessionTable


def store(url: str, **kw) -> RedisAffinityStore:
    kw.setdefault("retry_after_s", 0.05)
    return RedisAffinityStore(SessionTable(), url, key_prefix="t:", **kw)


async def test_two_routers_agree_on_a_session_home(redis_server):
    a, b = store(redis_server.url), store(redis_server.url)
    await a.start(), await b.start()
    try:
        # Both decide concurrently for a new session; the first writer wins, the other follows.
        homes = await asyncio.gather(
            a.begin("sess", "http://r1", force=False, tokens=1000),
            b.begin("sess", "http://r2", force=False, tokens=1000),
        )
        assert homes[0] == homes[1]
        assert (await a.get("sess")).home == (await b.get("sess")).home == homes[0]
        # In-flight counts add up across routers.
        assert (await a.get("sess")).in_flight == 2
        await a.end("sess")
        assert (await b.get("sess")).in_flight == 1
        # A rehome overwrites.
        await b.end("sess")
        await a.begin("sess", "http://r3", force=True, tokens=1000)
        assert (await b.get("sess")).home == "http://r3"
    finally:
        await a.close(), await b.close()


async def test_a_dead_routers_in_flight_counts_expire(redis_server):
    a, b = store(redis_server.url, lease_s=0.3), store(redis_server.url, lease_s=0.3)
    await a.start(), await b.start()
    try:
        await a.begin("s", "http://r1", force=False, tokens=10)
        await a.begin("s", "http://r1", force=False, tokens=10)
        assert (await b.get("s")).in_flight == 2
        await a.close()  # router a dies: its heartbeat stops, counts never released
        for _ in range(100):
            if (await b.get("s")).in_flight == 0:
                break
            await asyncio.sleep(0.02)
        view = await b.get("s")
        assert view.in_flight == 0 and view.home == "http://r1"
    finally:
        await b.close()


async def test_redis_down_degrades_then_recovers(redis_server):
    s = store(redis_server.url, op_timeout_s=0.2)
    await s.start()
    try:
        await s.begin("s", "http://r1", force=False, tokens=10)
        await s.end("s")
        redis_server.kill()
        # Requests keep flowing on local state.
        view = await s.get("s")
        assert s.degraded and view.home == "http://r1"
        assert await s.begin("s2", "http://r2", force=False, tokens=5) == "http://r2"
        await s.end("s2")
        redis_server.start()
        for _ in range(100):
            await asyncio.sleep(0.06)
            if (await s.get("s")) and not s.degraded:
                break
        assert not s.degraded
        await s.begin("s3", "http://r3", force=False, tokens=5)
        assert (await s.get("s3")).home == "http://r3"
    finally:
        await s.close()


@pytest.mark.fault_matrix(
    fault="Redis answering slowly (SIGSTOPped)",
    clients_saw="affinity calls bounded by affinity.op_timeout_s, then local state; event loop never blocked",
)
async def test_slow_redis_is_bounded_by_timeouts(redis_server):
    s = store(redis_server.url, op_timeout_s=0.1, retry_after_s=5)
    await s.start()
    try:
        await s.begin("s", "http://r1", force=False, tokens=10)
        redis_server.pause()
        await s.get("s")  # times out once (the test's own timeout would catch a hang)...
        view = await s.get("s")  # ...then routes on local state while Redis is marked down
        assert s.degraded and view.home == "http://r1"
    finally:
        redis_server.resume()
        await s.close()


async def test_a_failed_release_is_given_back_when_redis_returns(redis_server):
    s = store(redis_server.url, op_timeout_s=0.2, lease_s=0.6)
    other = store(redis_server.url)
    await s.start(), await other.start()
    try:
        await s.begin("s", "http://r1", force=False, tokens=10)
        redis_server.pause()  # the release below fails: Redis would keep counting the request
        await s.end("s")
        redis_server.resume()
        for _ in range(100):  # the next heartbeat gives it back
            if (await other.get("s")).in_flight == 0:
                break
            await asyncio.sleep(0.05)
        assert (await other.get("s")).in_flight == 0
    finally:
        await s.close(), await other.close()
