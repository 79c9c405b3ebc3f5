"""RedisAffinityStore against a real Redis-protocol server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from kvrouter.router.affinity import RedisAffinityStore
from kvrouter.router.sessions import SessionTable


def store(url: str, **kw) -> RedisAffinityStore:
    kw.setdefault("retry_after_s", 0.05)
    return RedisAffinityStore(SessionTable(), url, key_prefix="t:", **kw)


async def request(s: RedisAffinityStore, key: str, home: str, *, force: bool = False, tokens: int = 10) -> str | None:
    """What the relay does for one request up to dispatch: acquire, then begin."""
    await s.acquire(key)
    return await s.begin(key, home, force=force, tokens=tokens)


async def test_two_routers_agree_on_a_session_home(redis_server):
    a, b = store(redis_server.url), store(redis_server.url)
    await a.start(), await b.start()
    try:
        # Both decide concurrently for a new session; the first writer wins, the other follows.
        homes = await asyncio.gather(request(a, "sess", "http://r1"), request(b, "sess", "http://r2"))
        assert homes[0] == homes[1]
        assert (await a.get("sess")).home == (await b.get("sess")).home == homes[0]
        # In-flight counts add up across routers.
        assert (await a.get("sess")).in_flight == 2
        await a.end("sess")
        await a.settle()  # the shared count is released in the background
        assert (await b.get("sess")).in_flight == 1
        # A rehome overwrites.
        await b.end("sess")
        await request(a, "sess", "http://r3", force=True)
        assert (await b.get("sess")).home == "http://r3"
        # A known home costs no second round trip: another request keeps it.
        assert await request(b, "sess", "http://r9") == "http://r3"
        assert (await a.get("sess")).in_flight == 2
    finally:
        await a.close(), await b.close()


async def test_a_dead_routers_in_flight_counts_expire(redis_server):
    a, b = store(redis_server.url, lease_s=0.3), store(redis_server.url, lease_s=0.3)
    await a.start(), await b.start()
    try:
        await request(a, "s", "http://r1")
        await request(a, "s", "http://r1")
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
        await request(s, "s", "http://r1")
        await s.end("s")
        await s.settle()
        redis_server.kill()
        # Requests keep flowing on local state.
        view = await s.get("s")
        assert s.degraded and view.home == "http://r1"
        assert await request(s, "s2", "http://r2") == "http://r2"
        await s.end("s2")
        redis_server.start()
        for _ in range(100):
            await asyncio.sleep(0.06)
            if (await s.get("s")) and not s.degraded:
                break
        assert not s.degraded
        await request(s, "s3", "http://r3")
        assert (await s.get("s3")).home == "http://r3"
    finally:
        await s.close()


async def test_slow_redis_is_bounded_by_timeouts(redis_server):
    s = store(redis_server.url, op_timeout_s=0.1, retry_after_s=5)
    await s.start()
    try:
        await request(s, "s", "http://r1")
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
        await request(s, "s", "http://r1")
        redis_server.pause()  # the release below fails: Redis would keep counting the request
        await s.end("s")
        await s.settle()  # ...after op_timeout_s
        redis_server.resume()
        for _ in range(100):  # the next heartbeat gives it back
            if (await other.get("s")).in_flight == 0:
                break
            await asyncio.sleep(0.05)
        assert (await other.get("s")).in_flight == 0
    finally:
        await s.close(), await other.close()


async def test_releases_ending_together_share_one_command(redis_server):
    """Decrements are batched: requests that end while one batch is on the wire go in the next
    command, so 200 ends over 50 sessions take a few commands, and every count returns to 0.
    (Before the blocking pool, the 200 concurrent acquires failed past redis-py's 100 connections.)"""
    import redis.asyncio as aioredis

    s = store(redis_server.url)
    other = store(redis_server.url)
    counter = aioredis.Redis.from_url(redis_server.url)
    await s.start(), await other.start()

    async def end_calls() -> int:
        stats = await counter.info("commandstats")
        return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))

    try:
        keys = [f"b{i % 50}" for i in range(200)]
        await asyncio.gather(*(request(s, k, "http://r1") for k in keys))
        assert not s.degraded  # 200 calls at once queue for the 32 connections, none fails
        assert (await other.get("b0")).in_flight == 4
        before = await end_calls()
        await asyncio.gather(*(s.end(k) for k in keys))
        await s.settle()
        assert 1 <= await end_calls() - before <= 3
        assert [(await other.get(k)).in_flight for k in sorted(set(keys))] == [0] * 50
        assert await counter.hgetall(s._key("b0")) == {b"home": b"http://r1"}  # count fields removed
    finally:
        await counter.aclose()
        await s.close(), await other.close()


async def test_counts_of_calls_with_unknown_outcome_are_set_right_by_the_heartbeat(redis_server):
    """Redis stalls longer than op_timeout_s: an acquire times out but Redis runs it afterwards
    (counted there, not here), and a release times out but runs too. The next heartbeat sets
    this router's count of each such session to what it knows, so nothing stays leaked or is
    released twice."""
    import redis.asyncio as aioredis

    s = store(redis_server.url, op_timeout_s=0.3)
    observer = aioredis.Redis.from_url(redis_server.url)
    await s.start()
    field = "r:" + s.router_id

    async def count(key: str) -> int:
        return int(await observer.hget(s._key(key), field) or 0)

    try:
        await request(s, "warm", "http://r1")
        await s.end("warm")  # every script loaded: a stalled call runs once Redis resumes
        await s.settle()
        await request(s, "two", "http://r1"), await request(s, "two", "http://r1")
        await request(s, "one", "http://r1")
        redis_server.pause()
        timed_out = asyncio.create_task(s.acquire("late"))  # runs on Redis after its timeout
        await s.end("one")  # the release is sent into the stall too
        await s.settle()
        await timed_out
        assert s.degraded and s._uncertain == {"late", "one"}
        redis_server.resume()  # the stalled calls run now
        for _ in range(100):
            if [await count(k) for k in ("two", "one", "late")] == [2, 0, 1]:
                break
            await asyncio.sleep(0.05)
        assert [await count(k) for k in ("two", "one", "late")] == [2, 0, 1]  # "late": leaked
        await s._heartbeat()
        assert [await count(k) for k in ("two", "one", "late")] == [2, 0, 0]
        assert not s._uncertain
        await s.end("late")  # the request itself ends (counted locally only): nothing to send
        await s.end("two")
        await s.settle()
        assert [await count(k) for k in ("two", "one", "late")] == [1, 0, 0]
    finally:
        redis_server.resume()
        await observer.aclose()
        await s.close()


async def test_redis_round_trips_per_request(start_app, start_router, redis_server):
    """Through a live router: a session's first request makes 3 Redis calls (acquire, claim
    the home, release), every later one 2 (acquire, release), the release after the response."""
    import aiohttp
    import redis.asyncio as aioredis

    from .fakes import FakeUpstream

    replica = await start_app(FakeUpstream().app())
    router, url = await start_router([replica], signals={"source": "health", "interval_s": 60},
                                     affinity={"store": "redis", "redis_url": redis_server.url, "lease_s": 600})
    counter = aioredis.Redis.from_url(redis_server.url)

    async def calls() -> int:
        stats = await counter.info("commandstats")
        return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as client:
            async def one(session: str) -> int:
                before = await calls()
                async with client.post(url + "/v1/chat/completions", json=chat,
                                       headers={"x-session-id": session}) as r:
                    assert r.status == 200
                await router.affinity.settle()
                return await calls() - before

            await one("warm-up")  # the first call loads each script (EVAL), and the heartbeat runs
            assert await one("first") == 3
            assert [await one("first") for _ in range(3)] == [2, 2, 2]
    finally:
        await counter.aclose()


async def test_a_cancelled_acquire_leaves_no_count(redis_server):
    """A client that goes away while acquire waits on Redis: nothing stays counted, locally or
    in Redis, whether or not Redis ran the script (here it does, once it is resumed)."""
    s, other = store(redis_server.url, op_timeout_s=2), store(redis_server.url)
    await s.start(), await other.start()
    try:
        redis_server.pause()
        pending = asyncio.create_task(s.acquire("c"))
        await asyncio.sleep(0.1)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert s.table.view("c").in_flight == 0
        redis_server.resume()  # the script runs now and counts the request...
        for _ in range(100):
            await asyncio.sleep(0.02)
            await s.settle()  # ...and the give-back follows it
            if (await other.get("c")).in_flight == 0 and s._flusher is None:
                break
        assert (await other.get("c")).in_flight == 0
    finally:
        redis_server.resume()
        await s.close(), await other.close()


async def test_a_crashed_heartbeat_loop_restarts_and_is_counted(redis_server):
    """The lease heartbeat runs supervised: an unexpected error restarts it (with backoff) and
    is counted, so this router's in-flight counts keep counting in Redis."""
    from kvrouter.metrics.router_metrics import RouterMetrics

    metrics = RouterMetrics()
    s = store(redis_server.url, lease_s=0.3, metrics=metrics)
    await s.start()
    real, calls = s._heartbeat, []

    async def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the heartbeat")
        await real()

    s._heartbeat = flaky  # type: ignore[method-assign]
    try:
        restarts = metrics.background_restarts.labels("redis-heartbeat")
        deadline = asyncio.get_running_loop().time() + 10
        while (restarts._value.get() < 1 or len(calls) < 3) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert restarts._value.get() == 1 and len(calls) >= 3  # crashed once, then beat on
        assert not s._heartbeat_task.done()
    finally:
        await s.close()
