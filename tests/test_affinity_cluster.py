"""The shared affinity store on a real 3-node Redis Cluster (affinity.redis_cluster)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import redis.asyncio as aioredis

from kvrouter.router.affinity import RedisAffinityStore
from kvrouter.router.sessions import SessionTable

from .fakes import FakeUpstream
from .redis_cluster import RedisCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = RedisCluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def store(cluster: RedisCluster, prefix: str, **kw) -> RedisAffinityStore:
    kw.setdefault("retry_after_s", 0.05)
    kw.setdefault("op_timeout_s", 2.0)  # the first call also learns the slot map
    return RedisAffinityStore(SessionTable(), cluster.url, key_prefix=prefix, cluster=True, **kw)


async def request(s: RedisAffinityStore, key: str, home: str, *, force: bool = False) -> str | None:
    await s.acquire(key)
    return await s.begin(key, home, force=force, tokens=10)


async def cluster_keys(cluster: RedisCluster, pattern: str) -> dict[int, list[str]]:
    """The keys matching `pattern` on each node (by port)."""
    found = {}
    for port in cluster.ports:
        r = aioredis.Redis(host="127.0.0.1", port=port)
        try:
            found[port] = [k.decode() for k in await r.keys(pattern)]
        finally:
            await r.aclose()
    return found


async def test_two_routers_share_a_session_home_through_the_cluster(cluster):
    a, b = store(cluster, "share:"), store(cluster, "share:")
    await a.start(), await b.start()
    try:
        sessions = [f"sess{i}" for i in range(30)]
        for key in sessions:  # both decide concurrently; the first writer wins, the other follows
            homes = await asyncio.gather(request(a, key, "http://r1"), request(b, key, "http://r2"))
            assert homes[0] == homes[1]
            assert (await a.get(key)).in_flight == 2
        for key in sessions:
            await a.end(key), await b.end(key)
        await a.settle(), await b.settle()
        assert [(await b.get(k)).in_flight for k in sessions] == [0] * 30
        await request(a, "sess0", "http://r3", force=True)  # a rehome is seen by the other router
        assert (await b.get("sess0")).home == "http://r3"
        assert not a.degraded and not b.degraded
    finally:
        await a.close(), await b.close()
    # The keys really are spread over the nodes (64 buckets, each one slot).
    per_node = await cluster_keys(cluster, "{share:*")
    assert all(per_node.values()), per_node


async def test_the_session_cap_holds_on_the_cluster(cluster):
    s = store(cluster, "cap:", max_sessions=16, buckets=8)  # 2 per bucket
    await s.start()
    try:
        await s.acquire("busy")  # in flight throughout: never evicted
        for i in range(120):
            await request(s, f"s{i}", "http://r1")
            await s.end(f"s{i}")
        await s.settle()
        assert not s.degraded
    finally:
        await s.close()
    sessions = [k for keys in (await cluster_keys(cluster, "{cap:*}s:*")).values() for k in keys]
    assert len(sessions) <= 16 + 1  # its cap, and the busy session's bucket may be over by one
    assert s._key("busy") in sessions
    assert s.evicted == 121 - len(sessions)


async def test_routers_configured_for_the_cluster_keep_a_session_on_one_replica(start_app, start_router, cluster):
    """Each session's first request goes to router A, the next ones to router B: B sends them
    where A placed the session (on its own, B would place new sessions at random among equals)."""
    replicas = [await start_app(FakeUpstream(name=f"u{i}").app()) for i in range(2)]
    quiet = {"source": "health", "interval_s": 60}
    affinity = {"store": "redis", "redis_url": cluster.url, "redis_cluster": True, "key_prefix": "rt:",
                "op_timeout_s": 2.0}
    server = {"host": "127.0.0.1", "port": 0, "replica_header": True}
    routers = [await start_router(replicas, affinity=affinity, signals=quiet, server=server) for _ in range(2)]
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}

    async def served_by(url: str, session: str) -> str:
        async with http.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session}) as resp:
            assert resp.status == 200
            await resp.read()
            return resp.headers["x-kvrouter-replica"]

    async with aiohttp.ClientSession() as http:
        for i in range(10):
            first = await served_by(routers[0][1], f"one{i}")
            assert [await served_by(routers[1][1], f"one{i}") for _ in range(2)] == [first, first]
    assert not any(router.affinity.degraded for router, _ in routers)
