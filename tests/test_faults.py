"""Faults injected into real servers and processes on 127.0.0.1, with counted outcomes.

Every request a client sends ends either complete or with a clear error (an OpenAI-shaped error
status, or an SSE `data: {"error": ...}` event followed by `data: [DONE]`); none hangs (every wait
is bounded), none is answered twice, and no replica keeps decoding for a client that has gone.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from kvrouter.loadtest.sim_server import SIM_KEY, build_app

from .fakes import FakeUpstream
from .procs import eventually, running_reqs, start_sim_proc, wait_http
from kvrouter.loadtest.compare import free_port

SLOW = 0.05  # simulated-model seconds per wall second: 100 tokens take ~3 s on "tiny"


def chat(session: str, max_tokens: int = 100, stream: bool = True) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"task {session} " + "code " * 50}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream, "session_id": session}


FAST_SIGNALS = {"interval_s": 0.05, "timeout_s": 0.2, "failure_threshold": 2, "stale_after_s": 1.0}


async def classify_stream(resp: aiohttp.ClientResponse, first: bytes = b"") -> str:
    """'ok' (ended with [DONE], no error event), 'error' (clean error event then [DONE], or an
    error status with an OpenAI-shaped body) or 'broken' (anything else: the outcome we forbid)."""
    if resp.status != 200:
        body = await resp.read()
        try:
            return "error" if "error" in orjson.loads(body) else "broken"
        except orjson.JSONDecodeError:
            return "broken"
    try:
        data = first + await asyncio.wait_for(resp.read(), 30)
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
        return "broken"
    if not data.endswith(b"data: [DONE]\n\n"):
        return "broken"
    events = [e for e in data.split(b"\n\n") if e.startswith(b"data: {")]
    errors = [e for e in events if b'"error"' in e and b'"upstream_error"' in e]
    if data.count(b"data: [DONE]") != 1:
        return "broken"  # answered twice
    return "error" if errors else "ok"


async def request_outcome(client: aiohttp.ClientSession, url: str, body: dict[str, Any],
                          headers: dict[str, str] | None = None) -> tuple[str, str | None]:
    async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        replica = resp.headers.get("x-kvrouter-replica")
        if resp.status == 503:
            assert resp.headers.get("Retry-After")
        if not body.get("stream"):
            if resp.status == 200:
                data = await resp.json()
                return ("ok" if data["choices"] else "broken"), replica
            return await classify_stream(resp), replica
        return await classify_stream(resp), replica


class FixedPortApp:
    """An in-process aiohttp app that can be stopped and started again on the same port."""

    def __init__(self, make_app, port: int | None = None) -> None:
        self.make_app = make_app
        self.port = port or free_port()
        self.runner: web.AppRunner | None = None
        self.app: web.Application | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.app = self.make_app()
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def fixed_apps():
    apps: list[FixedPortApp] = []

    def _make(make_app) -> FixedPortApp:
        a = FixedPortApp(make_app)
        apps.append(a)
        return a

    yield _make
    for a in apps:
        await a.stop()


def router_cfg(**extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"server": {"host": "127.0.0.1", "port": 0, "replica_header": True},
                           "signals": FAST_SIGNALS, "policy": {"name": "round_robin"}}
    cfg.update(extra)
    return cfg


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="All replicas down, then back (same ports)",
    clients_saw="503 + Retry-After (OpenAI-shaped) while down; /ready 503; 200s again after recovery, no router restart",
)
async def test_all_replicas_down_then_recovery(fixed_apps, start_router, fault_record):
    replicas = [fixed_apps(lambda i=i: build_app("tiny", time_scale=100.0, seed=i)) for i in range(2)]
    for r in replicas:
        await r.start()
    _, url = await start_router([r.url for r in replicas], **router_cfg())
    outcomes: Counter[str] = Counter()
    async with aiohttp.ClientSession() as client:
        for i in range(10):
            outcomes[(await request_outcome(client, url, chat(f"up-{i}", 10, stream=i % 2 == 0)))[0]] += 1
        assert outcomes == {"ok": 10}
        for r in replicas:
            await r.stop()
        down = Counter()
        for i in range(10):  # at once: connect failures are retried, then 503
            outcome, _ = await asyncio.wait_for(request_outcome(client, url, chat(f"down-{i}", 10)), 10)
            down[outcome] += 1
        assert down == {"error": 10}
        await wait_http(url, "/ready", status=503, timeout=10)
        async with client.get(url + "/v1/models") as resp:
            assert resp.status == 503 and resp.headers["Retry-After"]
        for r in replicas:
            await r.start()
        await wait_http(url, "/ready", timeout=10)
        back = Counter()
        for i in range(10):
            outcome, _ = await asyncio.wait_for(request_outcome(client, url, chat(f"back-{i}", 10)), 10)
            back[outcome] += 1
        assert back == {"ok": 10}
    fault_record.count(sent=30, ok=20, clean_errors=10)


@pytest.mark.timeout(90)
@pytest.mark.fault_matrix(
    fault="Replica SIGKILLed mid-stream (real `kvrouter sim-replica` process)",
    clients_saw="its streams end with one SSE error event + [DONE]; other streams complete; later requests go to the survivor",
)
async def test_replica_sigkilled_mid_stream(tmp_path, start_router, fault_record):
    procs = [start_sim_proc(tmp_path, time_scale=SLOW, seed=i, name=f"sim{i}") for i in range(2)]
    try:
        for _, u in procs:
            await wait_http(u)
        victim_proc, victim = procs[0]
        _, survivor = procs[1]
        router, url = await start_router([victim, survivor], **router_cfg(
            upstream={"max_attempts": 2, "connect_timeout_s": 1.0}))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
            responses = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=chat(f"k-{i}"))
                                               for i in range(16)))
            firsts = await asyncio.gather(*(asyncio.wait_for(r.content.readuntil(b"\n\n"), 10) for r in responses))
            where = [r.headers["x-kvrouter-replica"] for r in responses]
            assert set(where) == {victim, survivor}
            # 3 clients on the survivor go away mid-stream
            gone = [i for i, w in enumerate(where) if w == survivor][:3]
            for i in gone:
                responses[i].close()
            victim_proc.signal(signal.SIGKILL)
            kept = [i for i in range(16) if i not in gone]
            results = await asyncio.gather(*(classify_stream(responses[i], firsts[i]) for i in kept))
            by_replica = Counter((where[i], res) for i, res in zip(kept, results))
            assert by_replica[(victim, "error")] == where.count(victim)  # clean error event each
            assert by_replica[(survivor, "ok")] == where.count(survivor) - len(gone)
            assert "broken" not in results
            # later requests: all complete (the dead replica is retried away, then marked down)
            later = await asyncio.gather(*(request_outcome(client, url, chat(f"after-{i}", 20))
                                           for i in range(10)))
            assert [o for o, _ in later] == ["ok"] * 10
            assert all(r == survivor for _, r in later)
        # nothing keeps decoding for the clients that left (or at all)
        assert await eventually(lambda: _idle(survivor), timeout=10)
        assert not router.registry.view(victim).healthy
    finally:
        for p, _ in procs:
            p.stop()
    fault_record.count(sent=16 + 10, ok=results.count("ok") + 10,
                       clean_errors=results.count("error") + len(gone),
                       note=f"{len(gone)} clients left on purpose; survivor running count back to 0")


async def _idle(url: str) -> bool:
    return await running_reqs(url) == 0


async def _black_hole() -> tuple[asyncio.AbstractServer, str, list[int]]:
    """Accepts connections, reads whatever comes, never answers."""
    accepted = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            while await reader.read(65536):
                pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", accepted


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="Replica accepts connections and never answers",
    clients_saw="retried on a healthy replica (200) within upstream.total_timeout_s; alone: 503 + Retry-After",
)
async def test_replica_that_never_answers(start_app, start_router, fault_record):
    server, hole, accepted = await _black_hole()
    good = FakeUpstream(name="good")
    good_url = await start_app(good.app())
    try:
        _, url = await start_router([hole, good_url], **router_cfg(
            signals={"source": "health", "interval_s": 60},  # only requests find the fault
            upstream={"total_timeout_s": 0.5, "max_attempts": 2}))
        _, alone = await start_router([hole], **router_cfg(
            signals={"source": "health", "interval_s": 60},
            upstream={"total_timeout_s": 0.5, "max_attempts": 2}))
        async with aiohttp.ClientSession() as client:
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
            mixed = await asyncio.gather(*(asyncio.wait_for(request_outcome(client, url, {**body, "stream": i % 2 == 0}), 10)
                                           for i in range(8)))
            solo = await asyncio.gather(*(asyncio.wait_for(request_outcome(client, alone, body), 10)
                                          for i in range(4)))
    finally:
        server.close()
    assert [o for o, _ in mixed] == ["ok"] * 8
    assert len(good.requests) == 8  # each request answered exactly once
    assert accepted[0] >= 1
    assert [o for o, _ in solo] == ["error"] * 4
    fault_record.count(sent=12, ok=8, clean_errors=4)


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="Replica stalls mid-stream (headers and first event, then silence)",
    clients_saw="SSE error event + [DONE] when upstream.total_timeout_s expires; the replica sees the disconnect",
)
async def test_replica_stalls_mid_stream(start_app, start_router, fault_record):
    stall = asyncio.Event()  # never set
    upstream = FakeUpstream(chunks=5, hold_after_first=stall)
    _, url = await start_router([await start_app(upstream.app())], **router_cfg(
        signals={"source": "health", "interval_s": 60}, upstream={"total_timeout_s": 1.0}))
    async with aiohttp.ClientSession() as client:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        outcomes = await asyncio.gather(*(asyncio.wait_for(request_outcome(client, url, body), 10) for _ in range(4)))
    assert [o for o, _ in outcomes] == ["error"] * 4
    assert await eventually(upstream.disconnected.is_set)
    fault_record.count(sent=4, ok=0, clean_errors=4)


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="Replica answering 503 / 500",
    clients_saw="503: retried on another replica (200); 500: passed through once, not retried; all-503: 503 passed through",
)
async def test_replica_answering_500_and_503(start_app, start_router, fault_record):
    busy = FakeUpstream(name="busy", status=503)
    broken = FakeUpstream(name="broken", status=500)
    good = FakeUpstream(name="good")
    busy_url, broken_url, good_url = [await start_app(u.app()) for u in (busy, broken, good)]
    quiet = {"source": "health", "interval_s": 60}
    _, r503 = await start_router([busy_url, good_url], **router_cfg(signals=quiet))
    _, r500 = await start_router([broken_url], **router_cfg(signals=quiet))
    _, rall = await start_router([busy_url], **router_cfg(signals=quiet, upstream={"max_attempts": 2}))
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as client:
        retried = [await request_outcome(client, r503, {**body, "stream": i % 2 == 0}) for i in range(10)]
        statuses = []
        for _ in range(5):
            async with client.post(r500 + "/v1/chat/completions", json=body) as resp:
                statuses.append(resp.status)
                assert "error" in await resp.json()
        for _ in range(5):
            async with client.post(rall + "/v1/chat/completions", json=body) as resp:
                statuses.append(resp.status)
                assert "error" in await resp.json()
    assert [o for o, _ in retried] == ["ok"] * 10
    assert len(good.requests) == 10  # never answered twice
    assert statuses == [500] * 5 + [503] * 5
    assert len(broken.requests) == 5  # a 500 is not retried (the replica may have done the work)
    fault_record.count(sent=20, ok=10, clean_errors=10)


def _replica_with_metrics(state: dict[str, str]) -> web.Application:
    upstream = FakeUpstream(name=state["name"])
    app = upstream.app()

    async def metrics(request: web.Request) -> web.StreamResponse:
        if state["mode"] == "slow":
            await asyncio.sleep(30)
        if state["mode"] == "garbage":
            return web.Response(body=b"\x00\xff not { prometheus ] \n" * 100)
        return web.Response(text="sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\n")

    app.router.add_get("/metrics", metrics)
    return app


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="Replica /metrics slow (30 s) or garbage",
    clients_saw="all requests 200 on the others; the replica marked unhealthy, then healthy again once /metrics is fixed; router never blocked",
)
async def test_metrics_slow_or_garbage(start_app, start_router, fault_record):
    states = [{"name": "slow", "mode": "slow"}, {"name": "garbage", "mode": "garbage"},
              {"name": "good", "mode": "ok"}]
    apps = [_replica_with_metrics(s) for s in states]
    urls = [await start_app(a) for a in apps]
    router, url = await start_router(urls, **router_cfg())
    assert await eventually(lambda: [router.registry.view(u).healthy for u in urls] == [False, False, True])
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as client:
        outcomes = []
        for i in range(10):
            outcome, replica = await asyncio.wait_for(request_outcome(client, url, {**body, "stream": i % 2 == 0}), 5)
            outcomes.append(outcome)
            assert replica == urls[2]
        # the event loop is never blocked by a hanging scrape: /health answers while one hangs
        for _ in range(5):
            t0 = loop.time()
            async with client.get(url + "/health") as resp:
                assert resp.status == 200
            assert loop.time() - t0 < 2.0  # generous bound: a blocked loop would take the scrape's 30 s
        for s in states:
            s["mode"] = "ok"
        assert await eventually(lambda: all(router.registry.view(u).healthy for u in urls), timeout=10)
    assert outcomes == ["ok"] * 10
    assert router.metrics.poll_errors.labels(urls[0])._value.get() >= 2
    fault_record.count(sent=10, ok=10, clean_errors=0)


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="Replica removed mid-stream, then re-added",
    clients_saw="its in-flight streams complete; new requests go elsewhere; after re-add it takes new sessions again",
)
async def test_replica_removed_and_readded(start_app, start_router, fault_record):
    apps = [build_app("tiny", time_scale=SLOW * 4, seed=i) for i in range(2)]
    urls = [await start_app(a) for a in apps]
    router, url = await start_router(urls, **router_cfg(policy={"name": "coding-agent"}))
    a, b = urls
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        responses = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=chat(f"rm-{i}", 60))
                                           for i in range(8)))
        firsts = await asyncio.gather(*(asyncio.wait_for(r.content.readuntil(b"\n\n"), 10) for r in responses))
        where = [r.headers["x-kvrouter-replica"] for r in responses]
        assert a in where
        # one client leaves mid-stream
        gone = where.index(a)
        responses[gone].close()
        assert router.remove_replica(a)
        during = await asyncio.gather(*(request_outcome(client, url, chat(f"during-{i}", 5)) for i in range(6)))
        results = await asyncio.gather(*(classify_stream(r, f) for i, (r, f) in enumerate(zip(responses, firsts))
                                         if i != gone))
        assert router.add_replica(a)
        after = await asyncio.gather(*(request_outcome(client, url, chat(f"new-{i}", 5)) for i in range(4)))
    assert results == ["ok"] * 7  # in-flight streams on the removed replica finished normally
    assert [o for o, _ in during] == ["ok"] * 6 and {r for _, r in during} == {b}
    assert [o for o, _ in after] == ["ok"] * 4 and a in {r for _, r in after}
    for app in apps:
        sim = app[SIM_KEY]
        assert await eventually(lambda sim=sim: not sim.running_rids(), timeout=10)
    fault_record.count(sent=8 + 6 + 4, ok=7 + 6 + 4, clean_errors=1, note="1 client left on purpose")
