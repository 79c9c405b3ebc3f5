"""Admission control in the live router (router/admission_gate.py): the router-side queue in
priority order, a client leaving the queue, SLO 429s, and no change when it is off. A fake
replica holds its answers until the test lets them go, so the router sees a replica over its
high-water mark (`replica_max_running: 1`); the cost model's per-running-request term is made
large so that waiting for the replica is predicted faster than piling onto it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from .fakes import FakeUpstream

POLICY = {"name": "coding-agent",
          "params": {"replica_max_running": 1, "cost": {"decode_s_per_running": 10.0}}}
SIGNALS = {"source": "health", "interval_s": 60}


def chat(tag: str, **extra: object) -> dict[str, object]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": tag}], **extra}


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def tags(up: FakeUpstream) -> list[str]:
    return [r["body"]["messages"][0]["content"] for r in up.requests]


async def test_waiting_requests_leave_in_priority_order_and_class_field_is_not_forwarded(
        start_app, start_router) -> None:
    hold = asyncio.Event()
    up = FakeUpstream(hold_before_headers=hold)
    router, url = await start_router([await start_app(up.app())], policy=POLICY, signals=SIGNALS,
                                     admission={"queue": True, "max_wait_s": 30})
    gate = router.relay.admission
    assert gate is not None
    async with aiohttp.ClientSession() as client:
        async def send(tag: str, headers: dict[str, str] | None = None, **extra: object) -> int:
            async with client.post(url + "/v1/chat/completions", json=chat(tag, **extra),
                                   headers=headers) as r:
                await r.read()
                return r.status

        first = asyncio.create_task(send("A"))
        await until(lambda: len(up.requests) == 1)
        waiting = [asyncio.create_task(send("B-batch", {"x-priority": "batch"})),
                   asyncio.create_task(send("C-default")),
                   asyncio.create_task(send("D-interactive", priority="interactive"))]
        await until(lambda: len(gate.queue) == 3)
        assert len(up.requests) == 1  # nobody piled onto the busy replica
        async with client.get(url + "/metrics") as r:
            text = await r.text()
        assert 'kvrouter_admission_queue_depth{priority="batch"} 1.0' in text
        hold.set()
        assert await first == 200 and [await t for t in waiting] == [200, 200, 200]
    assert tags(up) == ["A", "D-interactive", "C-default", "B-batch"]
    assert "priority" not in up.requests[1]["body"]  # D's class name stayed in the router
    assert len(gate.queue) == 0


async def test_client_that_leaves_the_queue_is_removed_and_never_sent(start_app, start_router) -> None:
    hold = asyncio.Event()
    up = FakeUpstream(hold_before_headers=hold)
    router, url = await start_router([await start_app(up.app())], policy=POLICY, signals=SIGNALS,
                                     admission={"queue": True})
    gate = router.relay.admission
    assert gate is not None
    async with aiohttp.ClientSession() as client:
        first = asyncio.create_task(client.post(url + "/v1/chat/completions", json=chat("A")))
        await until(lambda: len(up.requests) == 1)
        leaver = asyncio.create_task(client.post(url + "/v1/chat/completions", json=chat("gone")))
        await until(lambda: len(gate.queue) == 1)
        leaver.cancel()
        await until(lambda: len(gate.queue) == 0)
        hold.set()
        async with await first as r:
            assert r.status == 200
        async with client.post(url + "/v1/chat/completions", json=chat("after")) as r:
            assert r.status == 200
        async with client.get(url + "/metrics") as r:
            text = await r.text()
    assert tags(up) == ["A", "after"]
    assert 'kvrouter_admission_wait_seconds_count{outcome="cancelled",priority="default"} 1.0' in text
    assert router.registry.snapshot().replicas[0].in_flight == 0  # every slot given back


async def test_request_predicted_to_miss_its_slo_gets_a_clean_429(start_app, start_router) -> None:
    hold = asyncio.Event()
    up = FakeUpstream(hold_before_headers=hold)
    router, url = await start_router([await start_app(up.app())], policy=POLICY, signals=SIGNALS,
                                     admission={"queue": True, "ttft_slo_s": 0.3})
    async with aiohttp.ClientSession() as client:
        first = asyncio.create_task(client.post(url + "/v1/chat/completions", json=chat("A")))
        await until(lambda: len(up.requests) == 1)
        # Its own tighter SLO: neither waiting (~0.5 s) nor piling on (10 s) meets 100 ms.
        async with client.post(url + "/v1/chat/completions", json=chat("now"),
                               headers={"x-ttft-slo-ms": "100"}) as r:
            assert r.status == 429
            assert int(r.headers["Retry-After"]) >= 1
            body = await r.json()
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == 429
        assert "SLO" in body["error"]["message"]
        # The global 0.3 s SLO: waiting was predicted to meet it, but the replica stayed busy;
        # at the SLO the request leaves the queue with a 429 rather than waiting on.
        async with client.post(url + "/v1/chat/completions", json=chat("late")) as r:
            assert r.status == 429 and "Retry-After" in r.headers
        hold.set()
        async with await first as r:
            assert r.status == 200
        async with client.get(url + "/metrics") as r:
            text = await r.text()
    assert tags(up) == ["A"]  # the rejected ones never reached the replica
    assert 'kvrouter_admission_rejections_total{priority="default",reason="slo"} 2.0' in text


async def test_admission_off_by_default_leaves_routing_unchanged(start_app, start_router) -> None:
    hold = asyncio.Event()
    up = FakeUpstream(hold_before_headers=hold)
    router, url = await start_router([await start_app(up.app())], policy=POLICY, signals=SIGNALS)
    assert router.relay.admission is None
    async with aiohttp.ClientSession() as client:
        sends = [asyncio.create_task(client.post(url + "/v1/chat/completions",
                                                 json=chat(str(i), priority="batch")))
                 for i in range(3)]
        await until(lambda: len(up.requests) == 3)  # all dispatched at once, as before
        hold.set()
        for task in sends:
            async with await task as r:
                assert r.status == 200
    assert all(r["body"]["priority"] == "batch" for r in up.requests)  # forwarded untouched


async def test_reloaded_policy_brings_its_own_high_water_marks(start_app, start_router) -> None:
    from kvrouter.policies.registry import build_policy

    up = FakeUpstream()
    router, url = await start_router([await start_app(up.app())], policy=POLICY, signals=SIGNALS,
                                     admission={"queue": True})
    gate = router.relay.admission
    assert gate is not None and gate.assessor.high_water.max_running == 1
    router.engine.policy = build_policy("coding-agent", {"replica_max_running": 7})  # as a reload does
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/chat/completions", json=chat("x")) as r:
            assert r.status == 200
    assert gate.assessor.high_water.max_running == 7


async def test_openai_client_sees_an_slo_429_as_a_rate_limit_error(start_app, start_router) -> None:
    import openai

    hold = asyncio.Event()
    up = FakeUpstream(hold_before_headers=hold)
    _, url = await start_router([await start_app(up.app())], policy=POLICY, signals=SIGNALS,
                                admission={"ttft_slo_s": 60})
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="tenant-key", max_retries=0)
    try:
        first = asyncio.create_task(client.chat.completions.create(**chat("A")))  # type: ignore[call-overload]
        await until(lambda: len(up.requests) == 1)
        try:
            await client.chat.completions.create(**chat("B"), extra_headers={"x-ttft-slo-ms": "50"})  # type: ignore[call-overload]
        except openai.RateLimitError as err:
            assert err.status_code == 429 and err.response.headers["Retry-After"].isdigit()
            assert "SLO" in err.message
        else:
            raise AssertionError("expected a 429")
        hold.set()
        assert (await first).choices[0].message.content == "hello"
    finally:
        await client.close()


async def test_a_waiter_whose_re_decision_fails_fails_alone(start_app, start_router) -> None:
    hold = asyncio.Event()
    up = FakeUpstream(hold_before_headers=hold)
    router, url = await start_router([await start_app(up.app())], policy=POLICY, signals=SIGNALS,
                                     admission={"queue": True, "max_wait_s": 300})
    gate = router.relay.admission
    assert gate is not None
    real_try = gate._try
    broken: list[object] = []  # the pending request whose re-decision raises (a stand-in bug)

    def failing_try(pending, *args, **kwargs):
        if pending in broken:
            raise RuntimeError("boom")
        return real_try(pending, *args, **kwargs)

    gate._try = failing_try  # type: ignore[method-assign]
    async with aiohttp.ClientSession() as client:
        async def send(tag: str) -> int:
            async with client.post(url + "/v1/chat/completions", json=chat(tag)) as r:
                body = await r.json()
                assert "error" in body or r.status == 200
                return r.status

        first = asyncio.create_task(send("A"))
        await until(lambda: len(up.requests) == 1)
        bad = asyncio.create_task(send("broken"))
        await until(lambda: len(gate.queue) == 1)
        good = asyncio.create_task(send("fine"))
        await until(lambda: len(gate.queue) == 2)
        broken.append(gate.queue.ordered()[0].item)  # "broken", first in the queue
        hold.set()
        assert await first == 200
        # answered when the replica frees up, not at the 300 s wait bound
        assert await asyncio.wait_for(bad, 20) == 500  # its request gets the error, nobody else's
        assert await asyncio.wait_for(good, 20) == 200
    assert tags(up) == ["A", "fine"]
    assert len(gate.queue) == 0
    assert router.registry.view(router.registry.urls()[0]).in_flight == 0  # no slot leaked


async def test_only_served_requests_count_as_completions(start_app, start_router, closed_port_url) -> None:
    up = FakeUpstream()
    router, url = await start_router(
        [closed_port_url, await start_app(up.app())], signals=SIGNALS,
        policy={"name": "round-robin"}, admission={"queue": True}, upstream={"max_attempts": 2})
    gate = router.relay.admission
    assert gate is not None
    async with aiohttp.ClientSession() as client:
        for tag in ("a", "b"):  # round robin: one of them tries the closed port first
            async with client.post(url + "/v1/chat/completions", json=chat(tag)) as r:
                assert r.status == 200
                await r.read()
    assert len(up.requests) == 2
    assert len(gate.meter._times) == 2  # the refused attempt freed a slot but completed nothing
