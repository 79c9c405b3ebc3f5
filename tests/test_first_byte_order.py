"""A stream's first bytes go to the client before the router's bookkeeping of them (the
time-to-first-byte metric, the placement's first byte, admission's calibration), and that
bookkeeping is never lost: not when the client goes away as the first bytes are written, and
the decision log still has the request's line with its time to first byte."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import aiohttp
from aiohttp import ClientSession, web

from kvrouter.router import data_http
from kvrouter.router.decision_log import LOG_FORMAT
from kvrouter.router.placement import Placement

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hello"}]}
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


def _streaming_app(release: asyncio.Event) -> web.Application:
    """A replica that sends its head, then a token, then waits for `release` to end."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(TOKEN)
        await release.wait()
        await resp.write_eof(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    return app


async def _logged_router(start_app, start_router, path: Path, release: asyncio.Event, **config: Any):
    """A replica streaming once `release` is set, and a router in front of it writing its
    decision log to `path` (no polls during a test); returns (router, url, replica)."""
    replica = await start_app(_streaming_app(release))
    router, url = await start_router([replica], signals={"interval_s": 60},
                                     observability={"decision_log": str(path)}, **config)
    return router, url, replica


def _ttfb_count(router: Any, replica: str) -> float:
    router.metrics.render()  # deferred observations reach the histograms
    return router.metrics.registry.get_sample_value(
        "kvrouter_upstream_ttfb_seconds_count", {"replica": replica}) or 0.0


async def _lines(path: Path, n: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists() and path.stat().st_size:
            lines = [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]
            assert lines[0] == {"format": LOG_FORMAT}
            if len(lines) > n:
                return lines[1:]
        assert time.monotonic() < deadline, f"decision log has fewer than {n} lines"
        await asyncio.sleep(0.02)


def _record_order(monkeypatch) -> list[str]:
    """Log, in order, the data port's stream writes and the placements' first-byte records."""
    events: list[str] = []
    write, first_byte = data_http.StreamResponse.write, Placement.first_byte

    async def logged_write(self, data: bytes) -> None:
        events.append("client_write")
        await write(self, data)

    def logged_first_byte(self, *args, **kwargs) -> None:
        events.append("first_byte")
        first_byte(self, *args, **kwargs)

    monkeypatch.setattr(data_http.StreamResponse, "write", logged_write)
    monkeypatch.setattr(Placement, "first_byte", logged_first_byte)
    return events


async def test_the_first_bytes_go_out_before_their_bookkeeping(start_app, start_router, monkeypatch):
    events = _record_order(monkeypatch)
    release = asyncio.Event()
    replica = await start_app(_streaming_app(release))
    router, url = await start_router([replica], signals={"interval_s": 60})
    async with ClientSession() as client:
        async with client.post(url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            assert (await resp.content.readuntil(b"\n\n")) == TOKEN
            release.set()
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    assert events[:2] == ["client_write", "first_byte"]
    assert events.count("first_byte") == 1 and _ttfb_count(router, replica) == 1


async def test_a_client_gone_as_the_first_bytes_are_written_still_leaves_every_record(
        start_app, start_router, monkeypatch, tmp_path: Path):
    """The client's connection fails on the first write: the first byte, the TTFB metric, the
    request's metrics and its decision-log line are all still recorded."""
    events = _record_order(monkeypatch)
    write = data_http.StreamResponse.write

    async def gone(self, data: bytes) -> None:
        await write(self, data)  # (logged)
        self._conn.transport.abort()  # as if the client had gone: the write's error follows
        raise ConnectionResetError("client connection closed")

    monkeypatch.setattr(data_http.StreamResponse, "write", gone)
    release = asyncio.Event()
    path = tmp_path / "decisions.jsonl"
    router, url, replica = await _logged_router(start_app, start_router, path, release)
    try:
        async with ClientSession() as client:
            async with client.post(url + "/v1/chat/completions", json=CHAT) as resp:
                await resp.read()
    except aiohttp.ClientError:  # the connection was cut: only the router's records matter here
        pass
    finally:
        release.set()
    (line,) = await _lines(path, 1)
    assert line["replica"] == replica and line["status"] == 499
    assert line["ttft_s"] is not None and line["ttft_s"] > 0
    assert events[:2] == ["client_write", "first_byte"] and events.count("first_byte") == 1
    assert _ttfb_count(router, replica) == 1
    router.metrics.render()
    disconnects = router.metrics.registry.get_sample_value("kvrouter_client_disconnects_total") or 0.0
    assert disconnects == 1
    assert router.registry.snapshot().get(replica).in_flight == 0  # the slot was released


class _CountingAsyncio:
    """The asyncio module as one router module sees it, counting the calls that find the
    running loop with a getpid() system call (`current_task()` without a loop does too)."""

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    def get_running_loop(self) -> asyncio.AbstractEventLoop:
        self.calls += 1
        return asyncio.get_running_loop()

    def current_task(self, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task | None:
        if loop is None:
            self.calls += 1
        return asyncio.current_task(loop)


async def test_a_stream_on_a_pooled_connection_never_looks_the_loop_up(start_app, start_router,
                                                                        monkeypatch):
    """Each look-up of the running loop is a system call on the request's path: the relay and
    its upstream client take the loop from the connections they already hold."""
    from kvrouter.router import relay, upstream_http

    release = asyncio.Event()
    release.set()
    replica = await start_app(_streaming_app(release))
    _, url = await start_router([replica], signals={"interval_s": 60})
    counted = _CountingAsyncio()
    async with ClientSession() as client:
        for i in range(2):  # the first one opens the pooled connection
            if i == 1:
                monkeypatch.setattr(relay, "asyncio", counted)
                monkeypatch.setattr(upstream_http, "asyncio", counted)
            async with client.post(url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    assert counted.calls == 0


async def test_decision_notes_are_worked_out_once_the_request_is_sent(start_app, start_router,
                                                                      monkeypatch, tmp_path: Path):
    """With the decision log and a shadow policy on, the decision's notes (what it predicts,
    where the shadow would have sent the request) come after the request's bytes are written
    to the replica, and still reach the log line and the shadow metrics, once per request."""
    from kvrouter.router import upstream_http
    from kvrouter.router.engine import RoutingEngine

    events: list[str] = []
    made, notes = upstream_http._Connection.connection_made, RoutingEngine.notes

    relay_pools: list[Any] = []  # the relay's own: the poller's scrapes use the same client

    class LoggedTransport:
        def __init__(self, inner: Any, pool: Any) -> None:
            self._inner = inner
            self._pool = pool

        def write(self, data: bytes) -> None:
            self._inner.write(data)
            if self._pool in relay_pools:
                events.append("upstream_write")

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    def logged_made(self, transport) -> None:
        made(self, transport)
        self.transport = LoggedTransport(self.transport, self.pool)

    def logged_notes(self, *args, **kwargs):
        events.append("notes")
        return notes(self, *args, **kwargs)

    monkeypatch.setattr(upstream_http._Connection, "connection_made", logged_made)
    monkeypatch.setattr(RoutingEngine, "notes", logged_notes)
    release = asyncio.Event()
    release.set()
    path = tmp_path / "decisions.jsonl"
    router, url, replica = await _logged_router(start_app, start_router, path, release,
                                                routing={"shadow": ["consistent-hash"]})
    relay_pools.append(router.relay.pool)
    async with ClientSession() as client:
        for _ in range(2):  # the second goes on the pooled connection
            async with client.post(url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                await resp.read()
    # The first waits for a new connection (its notes come before that wait); the second is
    # written on the pooled connection at once, its notes after.
    assert events == ["notes", "upstream_write", "upstream_write", "notes"]
    for line in await _lines(path, 2):
        assert line["status"] == 200 and line["policy"] == "coding_agent"
        assert line["predicted_cached"] == 0 and line["predicted_ttft_s"] is not None
        assert line["shadow"]["consistent-hash"]["replica"] == replica
    router.metrics.render()
    agreed = router.metrics.registry.get_sample_value(
        "kvrouter_shadow_decisions_total", {"shadow": "consistent-hash", "agrees": "true"})
    assert agreed == 2


async def test_a_request_that_never_reaches_a_replica_still_logs_its_notes(
        start_router, closed_port_url, tmp_path: Path):
    path = tmp_path / "decisions.jsonl"
    router, url = await start_router([closed_port_url], signals={"interval_s": 60},
                                     observability={"decision_log": str(path)},
                                     routing={"shadow": ["consistent-hash"]},
                                     upstream={"max_attempts": 2})
    async with ClientSession() as client:
        async with client.post(url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 503
    (line,) = await _lines(path, 1)
    assert line["status"] == 503 and line["policy"] == "coding_agent"
    assert line["shadow"]["consistent-hash"]["replica"] == closed_port_url
    router.metrics.render()
    total = sum(router.metrics.registry.get_sample_value(
        "kvrouter_shadow_decisions_total", {"shadow": "consistent-hash", "agrees": a}) or 0.0
        for a in ("true", "false"))
    assert total == 1  # one placement: its retry has no replica left to go to
