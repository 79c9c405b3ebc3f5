"""The relay moves bytes; what each attempt means for routing is the placement's to record
(router/placement.py outcome calls), and the session's acquire/end is the engine's `route`.
Real aiohttp servers on loopback, a scripted policy so each attempt's replica is known."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from aiohttp import web

from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.policies.domain import Decision, RequestSummary, SessionView
from kvrouter.router.affinity import MemoryAffinityStore
from kvrouter.router.config import UpstreamConfig
from kvrouter.router.engine import RoutingEngine
from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.placement import Placement
from kvrouter.router.data_http import WholeResponse
from kvrouter.router.relay import Relay
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.router.sessions import SessionTable

from .test_placement import Scripted
from .test_supervise import wait_for


class CountingStore(MemoryAffinityStore):
    """The in-memory store, counting acquire/end per session; `gate` holds acquire back."""

    def __init__(self, table: SessionTable) -> None:
        super().__init__(table)
        self.acquired = 0
        self.ended = 0
        self.gate: asyncio.Event | None = None

    async def acquire(self, key: str) -> SessionView:
        if self.gate is not None:
            await self.gate.wait()
        self.acquired += 1
        return await super().acquire(key)

    async def end(self, key: str) -> None:
        self.ended += 1
        await super().end(key)


def answering(status: int, hang: asyncio.Event | None = None) -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if hang is not None:
            await hang.wait()
        return web.json_response({"ok": status == 200}, status=status)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return app


async def front(start_app, engine: RoutingEngine, store: CountingStore, **upstream) -> tuple[Relay, str]:
    """A router front end of one handler: a fixed summary (session "s1"), then the relay."""
    relay = Relay(engine, store, engine.metrics, UpstreamConfig(**upstream))

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        summary = RequestSummary(route="/v1/chat/completions", session_key="s1", prompt_tokens=10)
        answer = await relay.forward(request, body, summary, "rid-1")
        if isinstance(answer, WholeResponse):  # the data port's own whole answer: aiohttp's here
            return web.Response(status=answer.status, body=answer.body, headers=answer.headers)
        return answer

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)

    async def lifecycle(_app: web.Application):
        await relay.start()
        yield
        await relay.close()

    app.cleanup_ctx.append(lifecycle)
    return relay, await start_app(app)


def make_engine(replicas: list[str], *decisions: Decision) -> tuple[RoutingEngine, Scripted]:
    policy = Scripted(*decisions)
    table = SessionTable()
    engine = RoutingEngine(policy, ReplicaRegistry(replicas, failure_threshold=3), ShadowKVIndex(),
                           table, random.Random(0), metrics=RouterMetrics())
    return engine, policy


def spy(monkeypatch, name: str) -> list[tuple]:
    calls: list[tuple] = []
    original = getattr(Placement, name)

    def recording(self, *args):
        calls.append((self.url, *args))
        return original(self, *args)

    monkeypatch.setattr(Placement, name, recording)
    return calls


def value(counter, *labels: str) -> float:
    return counter.labels(*labels)._value.get()


async def post(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/chat/completions", json={"messages": []}) as resp:
            return resp.status, await resp.json()


async def test_connect_failure_is_recorded_once_by_the_placement_and_retried_elsewhere(
    start_app, closed_port_url, monkeypatch
):
    good = await start_app(answering(200))
    engine, policy = make_engine([closed_port_url, good], Decision(closed_port_url, "x"), Decision(good, "x"))
    store = CountingStore(engine.table)
    unreachable = spy(monkeypatch, "unreachable")
    answered = spy(monkeypatch, "answered")
    _, url = await front(start_app, engine, store, max_attempts=2)

    status, _ = await post(url)

    assert status == 200
    assert unreachable == [(closed_port_url, "connect")]
    assert answered == [(good,)]
    assert engine.registry._failures[closed_port_url] == 1  # one failure: the probe loop's threshold counts
    assert engine.registry._failures[good] == 0
    m = engine.metrics
    assert value(m.retries, "connect") == 1
    assert value(m.upstream_errors, closed_port_url, "connect") == 1
    assert policy.asked[1].exclude == frozenset({closed_port_url})  # elsewhere: away from it
    assert engine.registry.view(closed_port_url).in_flight == 0
    assert engine.registry.view(good).in_flight == 0
    assert (store.acquired, store.ended) == (1, 1)  # one session count over both attempts


async def test_503_before_any_byte_counts_a_retry_and_the_replica_stays_healthy(start_app, monkeypatch):
    busy = await start_app(answering(503))
    good = await start_app(answering(200))
    engine, _ = make_engine([busy, good], Decision(busy, "x"), Decision(good, "x"))
    store = CountingStore(engine.table)
    refused = spy(monkeypatch, "refused")
    _, url = await front(start_app, engine, store, max_attempts=2)

    status, _ = await post(url)

    assert status == 200
    assert refused == [(busy, 503)]
    m = engine.metrics
    assert value(m.retries, "http_503") == 1
    assert value(m.upstream_errors, busy, "http_503") == 1
    assert engine.registry._failures[busy] == 0  # it answered: reachable
    assert (store.acquired, store.ended) == (1, 1)


async def test_503_on_the_last_attempt_is_relayed_without_a_retry(start_app, monkeypatch):
    busy = await start_app(answering(503))
    engine, _ = make_engine([busy], Decision(busy, "x"))
    store = CountingStore(engine.table)
    refused = spy(monkeypatch, "refused")
    _, url = await front(start_app, engine, store, max_attempts=1)

    status, _ = await post(url)

    assert status == 503
    assert refused == []
    assert value(engine.metrics.retries, "http_503") == 0


async def test_client_going_away_ends_the_session_once(start_app):
    hang = asyncio.Event()
    slow = await start_app(answering(200, hang))
    engine, _ = make_engine([slow], Decision(slow, "x"))
    store = CountingStore(engine.table)
    relay, url = await front(start_app, engine, store)

    client = asyncio.create_task(post(url))
    await wait_for(lambda: engine.registry.view(slow).in_flight == 1)
    client.cancel()  # the client disconnects: the router's handler is cancelled
    with pytest.raises(asyncio.CancelledError):
        await client
    await wait_for(lambda: store.ended == 1)
    hang.set()
    assert store.acquired == 1 and store.ended == 1
    assert engine.table.view("s1").in_flight == 0
    assert engine.registry.view(slow).in_flight == 0


async def test_route_cancelled_in_acquire_never_ends_the_session():
    engine, _ = make_engine(["http://a"], Decision("http://a", "x"))
    store = CountingStore(engine.table)
    store.gate = asyncio.Event()
    summary = RequestSummary(route="/v1/chat/completions", session_key="s1")
    entered = []

    async def request() -> None:
        async with engine.route(summary, store) as route:
            entered.append(route)

    task = asyncio.create_task(request())
    await asyncio.sleep(0)  # parked in acquire
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert entered == [] and store.ended == 0


async def test_route_ends_the_session_once_even_if_the_body_fails():
    engine, _ = make_engine(["http://a"], Decision("http://a", "x"))
    store = CountingStore(engine.table)
    summary = RequestSummary(route="/v1/chat/completions", session_key="s1")
    route = engine.route(summary, store)
    with pytest.raises(RuntimeError):
        async with route:
            placement = route.place()
            assert placement is not None and placement.url == "http://a"
            placement.done()
            raise RuntimeError("boom")
    await route.__aexit__(None, None, None)  # a second exit ends nothing more
    assert (store.acquired, store.ended) == (1, 1)
    assert engine.table.view("s1").in_flight == 0
