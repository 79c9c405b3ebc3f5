"""Redis with AUTH, key prefix isolation, and no Redis password in any log line."""

from __future__ import annotations

import logging

import aiohttp
import pytest
import redis.asyncio as aioredis

from kvrouter.router.affinity_lua import BucketKeys

from .fakes import FakeUpstream
from .fault_ledger import fake_counts
from .redis_server import TEST_PASSWORD as PASSWORD

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def _requests(url: str, sessions: list[str], record=None) -> list[int]:
    """One chat request per session; with ``record`` (a fault ledger) each one is recorded."""
    statuses = []
    async with aiohttp.ClientSession() as client:
        for s in sessions:
            async with client.post(url + "/v1/chat/completions", json=CHAT, headers={"x-session-id": s}) as r:
                if record is not None:
                    await record.observe(r)
                statuses.append(r.status)
    return statuses


async def test_redis_auth_works_and_password_never_logged(start_app, start_router, redis_auth, caplog):
    caplog.set_level(logging.DEBUG)
    replica = await start_app(FakeUpstream().app())
    affinity = {"store": "redis", "redis_url": redis_auth.url, "key_prefix": "auth:"}
    router, url = await start_router([replica], affinity=affinity, signals={"source": "health", "interval_s": 60})
    assert await _requests(url, ["s1", "s2", "s1"]) == [200, 200, 200]
    assert not router.affinity.degraded
    r = aioredis.Redis.from_url(redis_auth.url)
    try:
        assert await r.hget(router.affinity._key("s1"), "home") == replica.encode()
    finally:
        await r.aclose()
    assert PASSWORD not in caplog.text
    assert "redis://:***@127.0.0.1" in caplog.text  # the store's start-up line, redacted


@pytest.mark.fault_matrix(
    fault="Redis with a wrong password (AUTH refused)",
    clients_saw="every request 200 on local affinity (degraded flag set); password in no log line",
)
async def test_wrong_redis_password_degrades_without_failing_or_leaking(start_app, start_router, redis_auth,
                                                                        caplog, fault_record):
    caplog.set_level(logging.DEBUG)
    upstream = FakeUpstream()
    replica = await start_app(upstream.app())
    wrong = f"redis://:not-{PASSWORD}@127.0.0.1:{redis_auth.port}/0"
    router, url = await start_router([replica], affinity={"store": "redis", "redis_url": wrong},
                                     signals={"source": "health", "interval_s": 60})
    statuses = await _requests(url, [f"w{i}" for i in range(5)], fault_record)
    assert statuses == [200] * 5
    assert router.affinity.degraded
    assert f"not-{PASSWORD}" not in caplog.text and PASSWORD not in caplog.text
    fault_record.replica(fake_counts("replica", upstream))


async def test_key_prefix_isolation(start_app, start_router, redis_server):
    replicas = [await start_app(FakeUpstream(name=f"u{i}").app()) for i in range(2)]
    quiet = {"source": "health", "interval_s": 60}
    _, url_a = await start_router(replicas, affinity={"store": "redis", "redis_url": redis_server.url, "key_prefix": "tenant-a:"},
                                  signals=quiet, policy={"name": "round_robin"})
    _, url_b = await start_router(replicas, affinity={"store": "redis", "redis_url": redis_server.url, "key_prefix": "tenant-b:"},
                                  signals=quiet, policy={"name": "round_robin"})
    assert await _requests(url_a, ["shared", "only-a"]) == [200, 200]
    assert await _requests(url_b, ["x", "shared"]) == [200, 200]  # round robin: "shared" lands elsewhere in b
    a, b = BucketKeys("tenant-a:", 1), BucketKeys("tenant-b:", 1)  # a single Redis: one bucket
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        keys = sorted(k.decode() for k in await r.keys("*"))
        home_a = await r.hget(a.session("shared"), "home")
        home_b = await r.hget(b.session("shared"), "home")
        routers_a = await r.zcard(a.routers[0])
        routers_b = await r.zcard(b.routers[0])
    finally:
        await r.aclose()
    assert all(k.startswith(("{tenant-a:", "{tenant-b:")) for k in keys), keys
    assert {a.session("shared"), a.session("only-a"), b.session("shared"), b.session("x")} <= set(keys)
    assert b.session("only-a") not in keys
    assert home_a == replicas[0].encode() and home_b == replicas[1].encode()  # independent homes
    assert routers_a == routers_b == 1  # each prefix sees only its own router's lease


async def test_redis_password_from_environment(start_app, start_router, redis_auth, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("KVROUTER_TEST_REDIS_PW", PASSWORD)
    replica = await start_app(FakeUpstream().app())
    bare = f"redis://127.0.0.1:{redis_auth.port}/0"
    router, url = await start_router([replica], affinity={"store": "redis", "redis_url": bare,
                                                          "password_env": "KVROUTER_TEST_REDIS_PW"},
                                     signals={"source": "health", "interval_s": 60})
    assert await _requests(url, ["e1", "e1"]) == [200, 200]
    assert not router.affinity.degraded
    assert PASSWORD not in caplog.text
