"""Requests in flight shared between routers on one Redis (router/peer_share.py): each router's
snapshot counts the others' dispatches in every replica's load, at once rather than at the next
poll of the replica, and forgets a router that went silent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import msgpack

from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.peer_share import PeerShare, share_channel
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.router.sessions import SessionTable
from kvrouter.router.supervise import spawn

from .fakes import FakeUpstream

R1, R2 = "http://r1", "http://r2"


async def _until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _share(url: str, **kwargs) -> PeerShare:
    registry = ReplicaRegistry([R1, R2])
    return PeerShare(url, share_channel("inflight-test:", 256), index=ShadowKVIndex(block_tokens=64),
                     table=SessionTable(), known=registry.__contains__, registry=registry, **kwargs)


def _peer(share: PeerShare, url: str) -> int:
    assert share.registry is not None
    view = share.registry.view(url)
    assert view is not None
    return view.peer_in_flight


async def test_counts_reach_the_other_router_and_go_when_it_falls_silent(redis_server):
    a = _share(redis_server.url, in_flight_refresh_s=0.05, in_flight_stale_s=0.5)
    b = _share(redis_server.url, in_flight_refresh_s=0.05, in_flight_stale_s=0.5)
    for s in (a, b):
        s.start(spawn)
    try:
        await asyncio.wait_for(asyncio.gather(a.subscribed.wait(), b.subscribed.wait()), 10)
        assert a.registry is not None and b.registry is not None
        a.registry.dispatched(R1, 1000)
        a.registry.dispatched(R1, 1000)
        a.registry.dispatched(R2, 1000)
        await _until(lambda: (_peer(b, R1), _peer(b, R2)) == (2, 1), "b to count a's requests")
        view = b.registry.view(R1)
        assert view is not None and view.load == 2 and view.in_flight == 0  # load, not its own
        assert (_peer(a, R1), _peer(a, R2)) == (0, 0)  # a never counts its own twice
        b.registry.dispatched(R1, 10)
        await _until(lambda: _peer(a, R1) == 1, "a to count b's request")
        assert a.registry.view(R1).load == 3  # type: ignore[union-attr]
        a.registry.completed(R2, 1000)
        await _until(lambda: _peer(b, R2) == 0, "b to see a's request end")
        # a stops publishing with requests still counted (it died, or lost Redis): b drops them.
        await a.close()
        await _until(lambda: _peer(b, R1) == 0, "b to forget a's counts")
        assert b.registry.view(R1).load == 1  # type: ignore[union-attr]
    finally:
        await a.close()
        await b.close()


def test_bad_counts_are_ignored_and_old_messages_still_read():
    share = _share("redis://127.0.0.1:9/0")
    for counts in ([R1], [R1, -1], [R1, "2"], [3, 1], {"r": 1}):
        assert share.apply(msgpack.packb([b"peer", [R1, b"\0" * 8], [], counts])) == 0
    assert _peer(share, R1) == 0 and share.index is not None and share.index.match([0]) == {}
    # Three members (a router that shares no counts): its records still apply.
    assert share.apply(msgpack.packb([b"old", [R1, b"\0" * 8], []])) == 1
    # Unknown replicas are skipped; the rest count.
    share.apply(msgpack.packb([b"peer", [], [], ["http://gone", 4, R2, 3]]))
    assert (_peer(share, R1), _peer(share, R2)) == (0, 3)


def test_the_routers_counted_are_bounded():
    share = _share("redis://127.0.0.1:9/0", max_peers=2)
    for sender in (b"p1", b"p2", b"p3"):
        share.apply(msgpack.packb([sender, [], [], [R1, 1, R2, 2]]))
    assert len(share._peers) == 2  # the least recent went, and its counts with it
    assert (_peer(share, R1), _peer(share, R2)) == (2, 4)
    share.apply(msgpack.packb([b"p3", [], [], []]))  # p3's requests all ended
    assert (_peer(share, R1), _peer(share, R2)) == (1, 2)


async def test_a_router_places_by_the_other_routers_requests_in_flight(start_app, start_router, redis_server):
    """Eight replicas, seven busy with requests router A holds; B (least-load, no polled load:
    only health is polled) must send its request to the eighth, which it can only know from A."""
    holds = [asyncio.Event() for _ in range(8)]
    replicas = [await start_app(FakeUpstream(name=f"r{i}", hold_before_headers=holds[i]).app())
                for i in range(8)]
    settings = dict(signals={"source": "health", "interval_s": 60}, server={"replica_header": True},
                    policy={"name": "least_load"},
                    affinity={"store": "redis", "redis_url": redis_server.url,
                              "key_prefix": "inflight-live:"})
    (a, url_a), (b, url_b) = [await start_router(replicas, **settings) for _ in range(2)]
    for router in (a, b):
        assert router.peer_share is not None
        await asyncio.wait_for(router.peer_share.subscribed.wait(), 10)

    def busy(router) -> dict[str, int]:
        return {v.id: v.in_flight for v in router.registry.snapshot().replicas if v.in_flight}

    def peer_busy(router) -> dict[str, int]:
        return {v.id: v.peer_in_flight for v in router.registry.snapshot().replicas if v.peer_in_flight}

    async def ask(client: aiohttp.ClientSession, url: str, k: int) -> str:
        body = {"model": "m", "messages": [{"role": "user", "content": f"question {k}"}]}
        async with client.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
            return resp.headers["x-kvrouter-replica"]

    async with aiohttp.ClientSession() as client:
        held = [asyncio.create_task(ask(client, url_a, k)) for k in range(7)]
        await _until(lambda: len(busy(a)) == 7, "A's seven requests to spread over seven replicas")
        await _until(lambda: peer_busy(b) == busy(a), "B to count A's requests")
        free = next(u for u in replicas if u not in busy(a))
        mine = asyncio.create_task(ask(client, url_b, 99))
        await _until(lambda: busy(b) != {}, "B to place its request")
        assert busy(b) == {free: 1}
        for hold in holds:
            hold.set()
        assert await mine == free
        await asyncio.gather(*held)
    await _until(lambda: peer_busy(b) == {} and peer_busy(a) == {}, "the counts to drop to zero")


async def test_a_router_sharing_no_counts_sends_the_three_member_message(redis_server):
    # routers from before in-flight sharing read only [sender, records, homes]
    import redis.asyncio as aioredis

    registry = ReplicaRegistry([R1])
    channel = share_channel("inflight-test:", 256)
    share = PeerShare(redis_server.url, channel, index=ShadowKVIndex(block_tokens=64),
                      table=None, known=registry.__contains__)
    listener = aioredis.Redis.from_url(redis_server.url)
    pubsub = listener.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(channel)
    share.start(spawn)
    try:
        await asyncio.wait_for(share.subscribed.wait(), 10)
        deadline = asyncio.get_running_loop().time() + 10
        message = None
        while message is None:  # again until one arrives: the listener may not be subscribed yet
            assert asyncio.get_running_loop().time() < deadline, "no message published"
            share.recorded(R1, [1, 2])
            message = await pubsub.get_message(timeout=0.1)
        decoded = msgpack.unpackb(message["data"])
        assert len(decoded) == 3 and decoded[1][0] == R1
    finally:
        await share.close()
        await pubsub.aclose()
        await listener.aclose()


async def test_closing_right_after_starting_ends_every_loop(redis_server):
    # a cancel landing as the subscriber's read times out was swallowed: close() then waited on
    # a loop that went on reading (a router's shutdown with it)
    for attempt in range(12):
        registry = ReplicaRegistry([R1])
        share = PeerShare(redis_server.url, share_channel("inflight-test:", 256),
                          index=ShadowKVIndex(block_tokens=64), table=None,
                          known=registry.__contains__, registry=registry)
        share.start(spawn)
        share.recorded(R1, [1])
        await asyncio.sleep(0.002 * attempt)
        closing = asyncio.ensure_future(share.close())
        done, _ = await asyncio.wait([closing], timeout=4)
        assert done, f"close() still waiting after 4 s (attempt {attempt})"
