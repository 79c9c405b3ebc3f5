"""Faults injected into real servers and processes on 127.0.0.1, with observed outcomes.

Every request a client sends is recorded in the `fault_record` ledger (tests/fault_ledger.py) with
what came back: complete, a clean error (an OpenAI-shaped error status, or an SSE
`data: {"error": ...}` event followed by `data: [DONE]`), or nothing. The replicas' own counts
(received, completed, aborted, still running) are recorded beside them; a test fails if a request
got nothing or the two sides disagree, whichever timeout or path ended it.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvrouter.loadtest.sim_server import SIM_KEY, build_app

from .fakes import FakeUpstream
from .fault_ledger import FaultRecord, ReplicaCounts, Request, fake_counts, read_outcome, sim_counts, sim_proc_counts
from .procs import eventually, running_reqs, start_sim_proc, wait_http
from kvrouter.loadtest.process_group import free_port

SLOW = 0.05  # simulated-model seconds per wall second: 100 tokens take ~3 s on "tiny"


def chat(session: str, max_tokens: int = 100, stream: bool = True) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"task {session} " + "code " * 50}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream, "session_id": session}


FAST_SIGNALS = {"interval_s": 0.05, "timeout_s": 0.2, "failure_threshold": 2, "stale_after_s": 1.0}


async def request_outcome(client: aiohttp.ClientSession, url: str, body: dict[str, Any],
                          record: FaultRecord, headers: dict[str, str] | None = None) -> tuple[str, str | None]:
    """Send one chat request through the router, record it, return ('ok'|'error'|'broken', replica)."""
    outcome = await record.request(client, url + "/v1/chat/completions", body, headers=headers)
    if outcome.status == 503:
        assert outcome.retry_after
    return outcome.short, outcome.replica


async def open_streams(client: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]],
                       record: FaultRecord) -> tuple[list[Request], list[aiohttp.ClientResponse], list[bytes]]:
    """Start streams and read each one's first event (the stream is then mid-flight)."""
    reqs = [record.send(b["session_id"]) for b in bodies]
    responses = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=b) for b in bodies))
    firsts = await asyncio.gather(*(asyncio.wait_for(r.content.readuntil(b"\n\n"), 10) for r in responses))
    return reqs, responses, firsts


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
            outcomes[(await request_outcome(client, url, chat(f"up-{i}", 10, stream=i % 2 == 0), fault_record))[0]] += 1
        assert outcomes == {"ok": 10}
        for i, r in enumerate(replicas):
            fault_record.replica(sim_counts(f"replica {i} (first life)", r.app[SIM_KEY]))
            await r.stop()
        down = Counter()
        for i in range(10):  # at once: connect failures are retried, then 503
            outcome, _ = await asyncio.wait_for(request_outcome(client, url, chat(f"down-{i}", 10), fault_record), 10)
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
            outcome, _ = await asyncio.wait_for(request_outcome(client, url, chat(f"back-{i}", 10), fault_record), 10)
            back[outcome] += 1
        assert back == {"ok": 10}
        for i, r in enumerate(replicas):
            sim = r.app[SIM_KEY]
            assert await eventually(lambda sim=sim: not sim.running_rids(), timeout=10)
            fault_record.replica(sim_counts(f"replica {i} (restarted)", sim))


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
            reqs, responses, firsts = await open_streams(client, url, [chat(f"k-{i}") for i in range(16)],
                                                         fault_record)
            where = [r.headers["x-kvrouter-replica"] for r in responses]
            assert set(where) == {victim, survivor}
            # 3 clients on the survivor go away mid-stream
            gone = [i for i, w in enumerate(where) if w == survivor][:3]
            for i in gone:
                responses[i].close()
                reqs[i].left()
            victim_counts = await sim_proc_counts("victim (as it was killed)", victim, gone=True)
            victim_proc.signal(signal.SIGKILL)
            kept = [i for i in range(16) if i not in gone]
            outcomes = await asyncio.gather(*(read_outcome(responses[i], firsts[i]) for i in kept))
            results = [reqs[i].got(o).short for i, o in zip(kept, outcomes)]
            by_replica = Counter((where[i], res) for i, res in zip(kept, results))
            assert by_replica[(victim, "error")] == where.count(victim)  # clean error event each
            assert by_replica[(survivor, "ok")] == where.count(survivor) - len(gone)
            assert "broken" not in results
            # later requests: all complete (the dead replica is retried away, then marked down)
            later = await asyncio.gather(*(request_outcome(client, url, chat(f"after-{i}", 20), fault_record)
                                           for i in range(10)))
            assert [o for o, _ in later] == ["ok"] * 10
            assert all(r == survivor for _, r in later)
        # nothing keeps decoding for the clients that left (or at all)
        assert await eventually(lambda: _idle(survivor), timeout=10)
        assert not router.registry.view(victim).healthy
        fault_record.replica(victim_counts)
        fault_record.replica(await sim_proc_counts("survivor", survivor))
    finally:
        for p, _ in procs:
            p.stop()
    fault_record.note(f"{len(gone)} clients left on purpose; the victim's counts are read just before SIGKILL")


async def _idle(url: str) -> bool:
    """Nothing running, as /v1/loads says now and as the /metrics gauges the ledger reads say
    (the simulated replica publishes those gauges on its own cadence, as SGLang does)."""
    return await running_reqs(url) == 0 and (await sim_proc_counts("idle?", url)).running == 0


class BlackHole:
    """Accepts connections, reads whatever comes, never answers. Counts the requests it received
    and those whose connection the peer closed (nothing is ever completed)."""

    def __init__(self) -> None:
        self.accepted = self.received = self.closed_by_peer = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        request = False
        try:
            while data := await reader.read(65536):
                if not request and data.startswith(b"POST "):
                    request = True
                    self.received += 1
            self.closed_by_peer += request
        finally:
            writer.close()

    def counts(self) -> ReplicaCounts:
        return ReplicaCounts("black hole", self.received, 0, self.closed_by_peer, 0,
                             self.received - self.closed_by_peer)


async def _black_hole() -> tuple[asyncio.AbstractServer, str, BlackHole]:
    hole = BlackHole()
    server = await asyncio.start_server(hole.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", hole


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="Replica accepts connections and never answers",
    clients_saw="requests already sent there: 504 once upstream.header_timeout_s passes (never re-run "
                "elsewhere: the replica may be working); the health poller takes it out, then every "
                "request goes to the healthy replica (200); alone: 504, then 503 + Retry-After",
)
async def test_replica_that_never_answers(start_app, start_router, fault_record):
    server, hole, black_hole = await _black_hole()
    good = FakeUpstream(name="good")
    good_url = await start_app(good.app())
    # Polls that time out after 2 s: the health poller finds the hang on its own, well after the
    # first requests were sent there (they end at the 0.5 s header timeout).
    signals = {"source": "health", "interval_s": 0.2, "timeout_s": 2.0, "failure_threshold": 1}
    upstream = {"header_timeout_s": 0.5, "max_attempts": 2}
    try:
        router, url = await start_router([hole, good_url], **router_cfg(signals=signals, upstream=upstream))
        lonely, alone = await start_router([hole], **router_cfg(signals=signals, upstream=upstream))
        async with aiohttp.ClientSession() as client:
            async def status(target: str, body: dict[str, Any]) -> int:
                return (await fault_record.request(client, target + "/v1/chat/completions", body)).status

            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
            # Round robin sends the first requests to both replicas, before any poll has failed.
            both = await asyncio.gather(*(status(url, {**body, "stream": i % 2 == 0}) for i in range(8)),
                                        *(status(alone, body) for _ in range(2)))
            first, solo_first = both[:8], both[8:]
            assert await eventually(lambda: not router.registry.healthy(hole), timeout=10)
            assert await eventually(lambda: not lonely.registry.healthy(hole), timeout=10)
            later = await asyncio.gather(*(status(url, {**body, "stream": i % 2 == 0})
                                           for i in range(8)))
            solo_later = await asyncio.gather(*(status(alone, body) for _ in range(2)))
        # the router closed every connection it gave up on
        assert await eventually(lambda: black_hole.received == black_hole.closed_by_peer, timeout=10)
    finally:
        server.close()
    assert set(first) == {200, 504}
    assert later == [200] * 8
    assert len(good.requests) == first.count(200) + 8  # each request answered exactly once
    assert solo_first == [504, 504]
    assert solo_later == [503, 503]
    fault_record.replica(black_hole.counts())
    fault_record.replica(fake_counts("good", good))


@pytest.mark.timeout(60)
@pytest.mark.fault_matrix(
    fault="Replica stalls mid-stream (headers and first event, then silence)",
    clients_saw="SSE error event + [DONE] once the router's upstream timeout fires; the replica sees the disconnect",
)
async def test_replica_stalls_mid_stream(start_app, start_router, fault_record):
    stall = asyncio.Event()  # never set
    upstream = FakeUpstream(chunks=5, hold_after_first=stall)
    _, url = await start_router([await start_app(upstream.app())], **router_cfg(
        signals={"source": "health", "interval_s": 60}, upstream={"total_timeout_s": 1.0}))
    async with aiohttp.ClientSession() as client:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        outcomes = await asyncio.gather(*(request_outcome(client, url, body, fault_record) for _ in range(4)))
    assert [o for o, _ in outcomes] == ["error"] * 4
    assert await eventually(lambda: upstream.running == 0)  # the replica saw every disconnect
    fault_record.replica(fake_counts("stalling replica", upstream))


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
        retried = [await request_outcome(client, r503, {**body, "stream": i % 2 == 0}, fault_record)
                   for i in range(10)]
        passed = [await fault_record.request(client, r + "/v1/chat/completions", body) for r in [r500] * 5 + [rall] * 5]
    assert [o for o, _ in retried] == ["ok"] * 10
    assert len(good.requests) == 10  # never answered twice
    assert [(o.kind, o.status) for o in passed] == [("clean_error", 500)] * 5 + [("clean_error", 503)] * 5
    assert len(broken.requests) == 5  # a 500 is not retried (the replica may have done the work)
    for name, upstream in (("answering 503", busy), ("answering 500", broken), ("good", good)):
        fault_record.replica(fake_counts(name, upstream))


def _replica_with_metrics(state: dict[str, str], upstreams: list[FakeUpstream]) -> web.Application:
    upstream = FakeUpstream(name=state["name"])
    upstreams.append(upstream)
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
    upstreams: list[FakeUpstream] = []
    apps = [_replica_with_metrics(s, upstreams) for s in states]
    urls = [await start_app(a) for a in apps]
    router, url = await start_router(urls, **router_cfg())
    assert await eventually(lambda: [router.registry.view(u).healthy for u in urls] == [False, False, True])
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as client:
        outcomes = []
        for i in range(10):
            outcome, replica = await request_outcome(client, url, {**body, "stream": i % 2 == 0}, fault_record)
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
    for s, upstream in zip(states, upstreams):
        fault_record.replica(fake_counts(s["name"], upstream))


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
        reqs, responses, firsts = await open_streams(client, url, [chat(f"rm-{i}", 60) for i in range(8)],
                                                     fault_record)
        where = [r.headers["x-kvrouter-replica"] for r in responses]
        assert a in where
        # one client leaves mid-stream
        gone = where.index(a)
        responses[gone].close()
        reqs[gone].left()
        assert router.membership.remove(a)
        during = await asyncio.gather(*(request_outcome(client, url, chat(f"during-{i}", 5), fault_record)
                                        for i in range(6)))
        kept = [i for i in range(8) if i != gone]
        outcomes = await asyncio.gather(*(read_outcome(responses[i], firsts[i]) for i in kept))
        results = [reqs[i].got(o).short for i, o in zip(kept, outcomes)]
        assert router.membership.add(a)
        after = await asyncio.gather(*(request_outcome(client, url, chat(f"new-{i}", 5), fault_record)
                                       for i in range(4)))
    assert results == ["ok"] * 7  # in-flight streams on the removed replica finished normally
    assert [o for o, _ in during] == ["ok"] * 6 and {r for _, r in during} == {b}
    assert [o for o, _ in after] == ["ok"] * 4 and a in {r for _, r in after}
    for name, app in zip(("removed and re-added", "other"), apps):
        sim = app[SIM_KEY]
        assert await eventually(lambda sim=sim: not sim.running_rids(), timeout=10)
        fault_record.replica(sim_counts(name, sim))
    fault_record.note("1 client left on purpose")
