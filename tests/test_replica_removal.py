"""A replica that leaves takes its state with it: no Prometheus series labelled with it, no
idle upstream connection or parsed URL in the relay's pool; adding it back works as new."""

from __future__ import annotations

import asyncio

import aiohttp

from .fakes import FakeUpstream

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def pool_holds(router, url: str) -> bool:
    pool = router.relay.pool
    port = int(url.rsplit(":", 1)[1])
    return url in pool._bases or any(key[2] == port and conns for key, conns in pool._idle.items())


async def test_removed_replica_leaves_no_series_and_no_pooled_connection(start_app, start_router):
    stays, leaves = FakeUpstream(name="stays"), FakeUpstream(name="leaves")
    stays_url = await start_app(stays.app())
    leaves_url = await start_app(leaves.app())
    router, url = await start_router([stays_url], policy={"name": "round_robin"},
                                     signals={"source": "health", "interval_s": 0.05})
    assert router.membership.add(leaves_url)
    async with aiohttp.ClientSession() as client:
        leaves.status = 503  # upstream errors, retries, failed health polls: series of every kind
        await wait_for(lambda: router.registry.view(leaves_url).healthy is False)
        leaves.status = 200
        await wait_for(lambda: router.registry.view(leaves_url).healthy)
        for _ in range(8):
            async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
        assert leaves.requests
        async with client.get(url + "/metrics") as r:
            before = await r.text()
        for name in ("kvrouter_upstream_ttfb_seconds_count", "kvrouter_replica_in_flight_requests",
                     "kvrouter_replica_healthy", "kvrouter_replica_poll_errors_total"):
            assert f'{name}{{replica="{leaves_url}"' in before, name
        await wait_for(lambda: pool_holds(router, leaves_url))

        assert router.membership.remove(leaves_url)
        async with client.get(url + "/metrics") as r:
            after = await r.text()
        assert leaves_url not in after
        assert stays_url in after  # the other replica's series are untouched
        assert not pool_holds(router, leaves_url)
        assert not any(leaves_url in key[1] for key in router.metrics._children)

        # Back again: a new replica, taking traffic and getting fresh series.
        assert router.membership.add(leaves_url)
        served = len(leaves.requests)
        for _ in range(8):
            async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
        assert len(leaves.requests) > served
        async with client.get(url + "/metrics") as r:
            again = await r.text()
        assert f'kvrouter_upstream_ttfb_seconds_count{{replica="{leaves_url}"}} ' in again


async def test_replica_removed_with_a_request_in_flight_leaves_nothing_once_it_ends(
        start_app, start_router):
    """Removal without drain while a stream is in flight: the stream finishes, and neither its
    metric series nor its keep-alive connection come back for the removed replica."""
    hold = asyncio.Event()
    leaves = FakeUpstream(name="leaves", hold_after_first=hold)
    leaves_url = await start_app(leaves.app())
    router, url = await start_router([leaves_url], signals={"source": "health", "interval_s": 0.05})
    body = {**CHAT, "stream": True}
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")  # the first event: the stream is in flight
            assert router.membership.remove(leaves_url)
            hold.set()
            rest = await r.read()
        assert rest.endswith(b"\n\n")
        async with client.get(url + "/metrics") as r:
            after = await r.text()
    assert leaves_url not in after
    assert not pool_holds(router, leaves_url)


async def test_replica_removed_before_its_answer_leaves_no_series(start_app, start_router):
    """Removed while the replica still prefills (no headers yet): the answer still reaches the
    client, and the series its first byte would recreate are gone once the request ends."""
    hold = asyncio.Event()
    leaves = FakeUpstream(name="leaves", hold_before_headers=hold)
    leaves_url = await start_app(leaves.app())
    router, url = await start_router([leaves_url], signals={"source": "health", "interval_s": 0.05})
    async with aiohttp.ClientSession() as client:
        pending = asyncio.ensure_future(client.post(url + "/v1/chat/completions", json=CHAT))
        await wait_for(lambda: len(leaves.requests) == 1)
        assert router.membership.remove(leaves_url)
        hold.set()
        async with await pending as r:
            assert r.status == 200
            await r.read()
        async with client.get(url + "/metrics") as r:
            after = await r.text()
    assert leaves_url not in after
    assert not pool_holds(router, leaves_url)
