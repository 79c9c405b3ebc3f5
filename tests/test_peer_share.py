"""Routing state shared between routers on one Redis (router/peer_share.py): a request without a
session key finds its prefix whichever router it reaches, and every router knows the KV homed on
each replica."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import aiohttp
import msgpack

from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.peer_share import PeerShare, share_channel
from kvrouter.router.sessions import SessionTable
from kvrouter.router.supervise import spawn

from .fakes import FakeUpstream

BLOCKS = (11, 12, 13, 14)


async def _until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _share(url: str, known: Callable[[str], bool] = lambda r: True) -> PeerShare:
    return PeerShare(url, share_channel("share-test:", 256), index=ShadowKVIndex(block_tokens=64),
                     table=SessionTable(), known=known)


async def test_a_record_reaches_the_other_routers_index_and_not_its_own(redis_server):
    a, b = _share(redis_server.url), _share(redis_server.url, known=lambda r: r != "http://gone")
    for s in (a, b):
        s.start(spawn)
    try:
        await asyncio.wait_for(asyncio.gather(a.subscribed.wait(), b.subscribed.wait()), 10)
        a.recorded("http://gone", BLOCKS)  # a replica b does not know: ignored there
        a.homed("s-gone", "http://gone", 100)
        a.recorded("http://r1", BLOCKS)
        a.homed("s1", "http://r1", 5000)
        await _until(lambda: b.index.match(BLOCKS) == {"http://r1": 4 * 64}, "b to learn a's record")
        assert b.table.homed_sessions == {"http://r1": 1} and b.table.homed_tokens == {"http://r1": 5000}
        assert b.table.view("s1").home == "http://r1"
        b.recorded("http://r2", BLOCKS[:2])
        await _until(lambda: a.index.match(BLOCKS[:2]) != {}, "a to learn b's record")
        # a's own message came back to it first (pub/sub echoes to every subscriber): skipped.
        assert a.index.match(BLOCKS) == {"http://r2": 2 * 64}
        assert a.table.homed_sessions == {}
        assert b.index.match(BLOCKS) == {"http://r1": 4 * 64}  # and b's own record is not in b
    finally:
        await a.close()
        await b.close()


def test_bad_messages_are_ignored():
    share = _share("redis://127.0.0.1:9/0")
    for payload in (b"\xc1", msgpack.packb({"not": "a list"}), msgpack.packb([b"x", ["r1"], []]),
                    msgpack.packb([b"x", ["r1", b"odd"], []]),  # 3 bytes: not a whole 8-byte block
                    msgpack.packb([b"x", [], ["s1", "r1", "many"]])):
        assert share.apply(payload) == 0
    assert share.index.match(BLOCKS) == {} and share.table.homed_sessions.get("r1", 0) == 0


def test_pending_records_are_bounded():
    share = _share("redis://127.0.0.1:9/0")
    share.max_pending = 2
    for _ in range(3):
        share.recorded("r1", BLOCKS)
        share.homed("s1", "r1", 10)
    assert len(share._records) // 2 + len(share._homes) // 3 == 2


async def test_keyless_conversations_stay_on_one_replica_across_two_routers(start_app, start_router, redis_server):
    """Turns of conversations without a session key, alternating between two routers on one
    Redis: each turn must find the replica that holds its conversation, though the router it
    reaches never saw the previous turn."""
    replicas = [await start_app(FakeUpstream(name=f"r{i}").app()) for i in range(4)]
    settings = dict(signals={"source": "health", "interval_s": 60}, server={"replica_header": True},
                    affinity={"store": "redis", "redis_url": redis_server.url, "key_prefix": "share-live:"})
    routers = [await start_router(replicas, **settings) for _ in range(2)]
    for router, _ in routers:
        assert router.peer_share is not None
        await asyncio.wait_for(router.peer_share.subscribed.wait(), 10)

    def received(router) -> float:
        return router.metrics.registry.get_sample_value("kvrouter_peer_share_total", {"event": "received"}) or 0

    conversations = {f"c{k}": [{"role": "user", "content": f"conversation {k}: " + "context " * 300}]
                     for k in range(8)}
    served: dict[str, set[str]] = {c: set() for c in conversations}
    sent = [0, 0]  # requests each router served
    async with aiohttp.ClientSession() as client:
        for turn in range(4):
            for name, messages in conversations.items():
                i = (turn + int(name[1:])) % 2
                router, url = routers[i]
                other = routers[1 - i][0]
                before = received(other)
                async with client.post(url + "/v1/chat/completions",
                                       json={"model": "m", "messages": messages}) as resp:
                    assert resp.status == 200, await resp.text()
                    reply = (await resp.json())["choices"][0]["message"]["content"]
                    served[name].add(resp.headers["x-kvrouter-replica"])
                sent[i] += 1
                # The other router has this turn's record before the conversation's next turn.
                await _until(lambda: received(other) > before, "the other router to learn the turn")
                messages += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": f"turn {turn} of {name}"}]
    assert all(len(r) == 1 for r in served.values()), served
    assert len(set().union(*served.values())) > 1, "conversations spread over replicas"
    assert min(sent) > 0


async def test_an_unreachable_redis_costs_requests_nothing(start_app, start_router, closed_port_url):
    """Publishing fails in the background (counted, the batch dropped); requests are served."""
    replica = await start_app(FakeUpstream().app())
    redis_url = closed_port_url.replace("http://", "redis://") + "/0"
    router, url = await start_router([replica], signals={"source": "health", "interval_s": 60},
                                     affinity={"store": "redis", "redis_url": redis_url})
    value = router.metrics.registry.get_sample_value
    prompt = {"model": "m", "messages": [{"role": "user", "content": "long context " * 100}]}
    async with aiohttp.ClientSession() as client:
        for _ in range(3):
            async with client.post(url + "/v1/chat/completions", json=prompt) as resp:
                assert resp.status == 200, await resp.text()
    await _until(lambda: (value("kvrouter_peer_share_total", {"event": "dropped"}) or 0) >= 3,
                 "the failed publishes to be counted")
    assert value("kvrouter_peer_share_total", {"event": "publish_errors"}) >= 1
    assert router.peer_share is not None and not router.peer_share.subscribed.is_set()


async def test_each_router_knows_the_sessions_homed_through_the_other(start_app, start_router, redis_server):
    """Sessions started through one router count in the other's homed totals (sessions and KV
    per replica), which new sessions are placed by."""
    replicas = [await start_app(FakeUpstream(name=f"r{i}").app()) for i in range(3)]
    settings = dict(signals={"source": "health", "interval_s": 60},
                    affinity={"store": "redis", "redis_url": redis_server.url, "key_prefix": "share-homes:"})
    (a, url_a), (b, _) = [await start_router(replicas, **settings) for _ in range(2)]
    for router in (a, b):
        assert router.peer_share is not None
        await asyncio.wait_for(router.peer_share.subscribed.wait(), 10)

    def homed(router) -> dict[str, tuple[int, int]]:
        return {v.id: (v.homed_sessions, v.homed_tokens) for v in router.registry.snapshot().replicas}

    async with aiohttp.ClientSession() as client:
        for s in range(6):
            content = f"session {s} " + "x" * (400 * (s + 1))
            async with client.post(url_a + "/v1/chat/completions", headers={"x-session-id": f"s{s}"},
                                   json={"model": "m", "messages": [{"role": "user", "content": content}]}) as resp:
                assert resp.status == 200, await resp.text()
    assert sum(n for n, _ in homed(a).values()) == 6
    await _until(lambda: homed(b) == homed(a), "b's homed totals to equal a's")


async def test_closing_while_publishing_returns_promptly(redis_server):
    """A router shutting down cancels a PUBLISH that may be on the wire: close() must not hang
    on it (it did, now and then, with redis-py's client)."""
    for round_ in range(12):
        share = _share(redis_server.url)
        share.start(spawn)
        await asyncio.wait_for(share.subscribed.wait(), 10)
        for k in range(round_ * 5):
            share.recorded("http://r1", range(500))
            share.homed("s1", "http://r1", k)
            await asyncio.sleep(0.001 * (k % 3))
        await asyncio.wait_for(share.close(), 5)
