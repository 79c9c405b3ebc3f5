"""Pending prefill through the live router: every way an attempt ends takes its prefill off the
replica it was on, a retry puts it on the next one, and only a streamed answer's first byte
says its prefill is done (a plain answer's first byte is its end). Real aiohttp servers on
loopback; a scripted policy, so each attempt's replica is known."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvrouter.policies.domain import Decision
from kvrouter.router.app import Router
from kvrouter.router.placement import Placement

from .fakes import FakeUpstream
from .test_pd_routing import _metric, _router_with_dead_decode, sim_fleet  # noqa: F401  (a fixture)
from .test_placement import Scripted
from .test_supervise import wait_for

CHAT = "/v1/chat/completions"
SIGNALS = {"source": "health", "interval_s": 60}


@pytest.fixture
def gates():
    """The replica's holds (before its answer's head, after its first chunk): released at
    teardown, so a failed test leaves nothing hanging."""
    before, after = asyncio.Event(), asyncio.Event()
    yield before, after
    before.set()
    after.set()


async def post(url: str, stream: bool) -> int:
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "word " * 400}]}
    async with aiohttp.ClientSession() as client:
        async with client.post(url + CHAT, json=body, headers={"x-session-id": "s"}) as resp:
            await resp.read()
            return resp.status


def pending(router: Router, url: str) -> int:
    return router.registry.view(url).pending_prefill_tokens


def in_flight(router: Router, url: str) -> int:
    return router.registry.view(url).in_flight


async def scripted_router(start_router, replicas: list[str], *order: str) -> tuple[Router, str]:
    router, url = await start_router(replicas, signals=SIGNALS, upstream={"max_attempts": 2})
    router.engine.policy = Scripted(*(Decision(r, "x") for r in order))
    return router, url


@pytest.mark.parametrize("failure", ["connect", "503"])
async def test_a_retry_takes_the_prefill_off_the_first_replica_and_puts_it_on_the_next(
        start_app, start_router, gates, closed_port_url, failure):
    before, after = gates
    good = await start_app(FakeUpstream(hold_before_headers=before, hold_after_first=after).app())
    bad = closed_port_url if failure == "connect" else await start_app(FakeUpstream(status=503).app())
    router, url = await scripted_router(start_router, [bad, good], bad, good)

    client = asyncio.create_task(post(url, stream=True))
    await wait_for(lambda: in_flight(router, good) == 1)
    prompt = router.registry.view(good).in_flight_prompt_tokens
    assert prompt > 0 and pending(router, good) == prompt  # nothing of it cached there
    assert pending(router, bad) == 0 and in_flight(router, bad) == 0
    before.set()
    await wait_for(lambda: pending(router, good) == 0)
    assert in_flight(router, good) == 1  # answered its first byte, still streaming
    after.set()
    assert await client == 200
    assert pending(router, good) == 0 and in_flight(router, good) == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_gone_before_the_first_byte_leaves_no_prefill_pending(
        start_app, start_router, gates, stream):
    before, _ = gates
    up = FakeUpstream(hold_before_headers=before)
    slow = await start_app(up.app())
    router, url = await scripted_router(start_router, [slow], slow)

    client = asyncio.create_task(post(url, stream=stream))
    await wait_for(lambda: in_flight(router, slow) == 1)
    client.cancel()
    with pytest.raises(asyncio.CancelledError):
        await client
    await wait_for(lambda: in_flight(router, slow) == 0)
    assert pending(router, slow) == 0


async def test_a_replica_answering_an_error_takes_its_prefill_off(start_app, start_router):
    failing = await start_app(FakeUpstream(status=500).app())
    router, url = await scripted_router(start_router, [failing], failing)
    assert await post(url, stream=True) == 500
    assert pending(router, failing) == 0 and in_flight(router, failing) == 0


async def test_a_plain_answer_puts_no_prefill_pending_its_first_byte_is_its_end(
        start_app, start_router, gates):
    # SGLang answers a request that does not stream whole, at its end: its first byte comes
    # long after its prefill. Pending until then, it would be counted as prefill work ahead of
    # the next request on that replica for the whole of its decode.
    before, _ = gates
    slow = await start_app(FakeUpstream(hold_before_headers=before).app())
    router, url = await scripted_router(start_router, [slow], slow)

    client = asyncio.create_task(post(url, stream=False))
    await wait_for(lambda: in_flight(router, slow) == 1)
    assert pending(router, slow) == 0
    before.set()
    assert await client == 200
    assert pending(router, slow) == 0 and in_flight(router, slow) == 0



async def test_a_pd_pair_retried_after_its_decode_half_failed_leaves_no_prefill_pending(
        start_router, sim_fleet, closed_port_url, monkeypatch):
    # A decode server that never got the request: the prefill half is placed again on the same
    # server (`Placement.again`); each attempt's prefill comes off, the last at its first byte.
    router, url, prefill = await _router_with_dead_decode(start_router, sim_fleet, closed_port_url)
    failures = 'kvrouter_pd_bootstrap_failures_total{stage="decode"}'
    again, placed_again = Placement.again, []
    monkeypatch.setattr(Placement, "again", lambda self: (placed_again.append(self.url), again(self))[1])
    server = prefill[0][1]
    async with aiohttp.ClientSession() as client:
        for _ in range(12):  # the pick ties at random between the two idle decode servers
            async with client.post(url + CHAT, json={
                "model": "tiny", "stream": True, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hello there " * 50}],
            }) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            assert in_flight(router, server) == 0 and pending(router, server) == 0
            if await _metric(url, failures):
                break
    assert await _metric(url, failures) >= 1 and placed_again
