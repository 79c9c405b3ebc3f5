"""The affinity store's pipelined Redis connection (router/redis_pipe.py) against a real
Redis-protocol server on 127.0.0.1 (redis-py is only the independent observer here)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from kvrouter.router.redis_pipe import PipelinedRedis, RedisConnectionError, RedisError, Script, pack

from .redis_server import TEST_PASSWORD


async def _clients(url: str) -> int:
    observer = aioredis.Redis.from_url(url)
    try:
        return int((await observer.info("clients"))["connected_clients"]) - 1
    finally:
        await observer.aclose()


def test_commands_are_resp_arrays_of_bulk_strings() -> None:
    assert pack((b"SET", "k", 5, 0.5)) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n5\r\n$3\r\n0.5\r\n"
    with pytest.raises(TypeError):
        pack((b"SET", None))


async def test_concurrent_calls_share_one_connection_and_keep_their_order(redis_server) -> None:
    r = PipelinedRedis(redis_server.url, timeout=5)
    try:
        results = await asyncio.gather(*(r.execute(b"INCRBY", "n", i) for i in range(1, 501)))
        assert results == [i * (i + 1) // 2 for i in range(1, 501)]  # each sees all before it
        assert await _clients(redis_server.url) == 1
        with pytest.raises(RedisError):
            await r.execute(b"INCRBY", "n", "not-a-number")
        assert await r.execute(b"GET", "n") == b"125250"  # an error reply leaves it usable
    finally:
        await r.aclose()


async def test_a_cancelled_call_keeps_replies_in_step(redis_server) -> None:
    r = PipelinedRedis(redis_server.url, timeout=5)
    try:
        slow = asyncio.create_task(r.execute(b"BLPOP", "empty", "0.3"))  # holds the connection
        await asyncio.sleep(0.05)
        after = asyncio.create_task(r.execute(b"ECHO", "mine"))
        await asyncio.sleep(0.01)
        slow.cancel()  # its reply still arrives first, and must not be handed to `after`
        assert not after.done()
        assert await after == b"mine"
        assert await r.execute(b"ECHO", "next") == b"next"
    finally:
        await r.aclose()


async def test_a_stall_fails_only_the_calls_that_outwait_it(redis_server) -> None:
    """A call that times out does not take the others down with it: one sent later, whose own
    deadline outlasts the stall, gets its reply (the late one is skipped, not mismatched)."""
    r = PipelinedRedis(redis_server.url, timeout=1.0)
    try:
        assert await r.execute(b"PING") == b"PONG"
        redis_server.pause()
        early = asyncio.create_task(r.execute(b"INCR", "stall"))
        await asyncio.sleep(0.5)
        later = asyncio.create_task(r.execute(b"INCR", "stall"))
        with pytest.raises(TimeoutError):
            await early
        redis_server.resume()  # `later` still has ~0.5 s of its own deadline
        assert await later == 2  # Redis ran both, in order; the reply to `early` was skipped
        assert await r.execute(b"ECHO", "in step") == b"in step"
    finally:
        redis_server.resume()
        await r.aclose()


async def test_a_connection_silent_for_dead_after_is_dropped(redis_server) -> None:
    r = PipelinedRedis(redis_server.url, timeout=0.2)
    r.dead_after = 0.5
    try:
        assert await r.execute(b"PING") == b"PONG"
        first = r._conn
        redis_server.pause()
        for _ in range(4):  # 0.8 s of calls timing out: past dead_after the connection goes
            with pytest.raises(TimeoutError):
                await r.execute(b"PING")
        assert first is not None and first.closed
        redis_server.resume()
        assert await r.execute(b"PING") == b"PONG"  # a new connection
        assert r._conn is not first
    finally:
        redis_server.resume()
        await r.aclose()


async def test_a_bad_argument_leaves_no_call_without_its_reply(redis_server) -> None:
    r = PipelinedRedis(redis_server.url, timeout=5)
    try:
        await r.execute(b"MSET", "a", "A", "b", "B")
        for bad in (None, True):
            with pytest.raises(TypeError):
                await r.execute(b"SET", "x", bad)
        assert await asyncio.gather(r.execute(b"GET", "a"), r.execute(b"GET", "b")) == [b"A", b"B"]
    finally:
        await r.aclose()


async def test_a_refusing_server_is_reported_at_once_not_after_the_timeout(redis_server) -> None:
    admin = PipelinedRedis(redis_server.url, timeout=5)
    r = PipelinedRedis(redis_server.url, timeout=30)
    try:
        await admin.execute(b"CONFIG", "SET", "maxclients", "1")
        with pytest.raises((RedisConnectionError, RedisError), match="max"):
            await r.execute(b"PING")  # a 30 s timeout: a hang would fail the test's own timeout
    finally:
        await admin.execute(b"CONFIG", "SET", "maxclients", "10000")
        await admin.aclose(), await r.aclose()


async def test_closing_while_connecting_is_a_connection_error(redis_server) -> None:
    r = PipelinedRedis(redis_server.url.rsplit("/", 1)[0] + "/3", timeout=5)  # SELECT on connect
    redis_server.pause()  # the TCP handshake completes (kernel backlog), SELECT never answers
    try:
        call = asyncio.create_task(r.execute(b"PING"))
        await asyncio.sleep(0.2)
        await r.aclose()
        with pytest.raises(RedisConnectionError):
            await call
    finally:
        redis_server.resume()


async def test_a_killed_server_fails_calls_then_a_restarted_one_serves(redis_server) -> None:
    r = PipelinedRedis(redis_server.url, timeout=1)
    try:
        assert await r.execute(b"PING") == b"PONG"
        redis_server.kill()
        with pytest.raises((RedisConnectionError, TimeoutError)):
            await r.execute(b"PING")
        redis_server.start()
        for _ in range(50):
            try:
                assert await r.execute(b"PING") == b"PONG"
                break
            except (RedisConnectionError, TimeoutError):
                await asyncio.sleep(0.1)
        else:
            pytest.fail("never reconnected")
    finally:
        await r.aclose()


async def test_scripts_are_loaded_again_after_a_flush(redis_server) -> None:
    r = PipelinedRedis(redis_server.url, timeout=5)
    script = Script("return tonumber(ARGV[1]) + redis.call('INCR', KEYS[1])")
    try:
        assert await r.evalsha(script, ["s"], [10]) == 11  # NOSCRIPT, then EVAL
        assert await r.evalsha(script, ["s"], [10]) == 12  # EVALSHA
        await r.execute(b"SCRIPT", "FLUSH")
        assert await r.evalsha(script, ["s"], [10]) == 13
    finally:
        await r.aclose()


async def test_auth_and_database_from_the_url(redis_auth) -> None:
    host = f"127.0.0.1:{redis_auth.port}"
    good = PipelinedRedis(f"redis://:{TEST_PASSWORD}@{host}/3", timeout=5)
    separate = PipelinedRedis(f"redis://{host}/0", timeout=5, password=TEST_PASSWORD)
    wrong = PipelinedRedis(f"redis://:{TEST_PASSWORD}@{host}/0", timeout=5, password="wrong")
    try:
        await good.execute(b"SET", "where", "db3")
        assert await separate.execute(b"GET", "where") is None  # database 0
        await separate.execute(b"SELECT", 3)
        assert await separate.execute(b"GET", "where") == b"db3"
        with pytest.raises(RedisError):
            await wrong.execute(b"PING")
    finally:
        await good.aclose(), await separate.aclose(), await wrong.aclose()


async def test_closed_client_refuses_calls(redis_server) -> None:
    r = PipelinedRedis(redis_server.url, timeout=5)
    assert await r.execute(b"PING") == b"PONG"
    await r.aclose()
    with pytest.raises(RedisConnectionError):
        await r.execute(b"PING")
