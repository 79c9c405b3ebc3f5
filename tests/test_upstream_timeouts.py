"""Upstream timeouts and the SSE event cap through a live router, against real aiohttp replicas on
127.0.0.1 that stall before their headers, stall mid-stream, drip slowly, or never end an event.

Only connect failures are retried and count against a replica's health; a replica that got the
request and then timed out (headers, idle gap, total) is neither retried nor marked down, and its
connection is closed so it stops working on the request."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from .fakes import FakeUpstream, chat_chunk

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
QUIET = {"source": "health", "interval_s": 60, "failure_threshold": 1}  # requests alone judge health


class ScriptedReplica:
    """One route whose answer a test scripts; records requests and sees the router hang up."""

    def __init__(self, script: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        self.script = script
        self.requests = 0
        self.disconnected = asyncio.Event()

    def app(self) -> web.Application:
        async def handle(request: web.Request) -> web.StreamResponse:
            await request.read()
            self.requests += 1
            try:
                return await self.script(request)
            except (asyncio.CancelledError, ConnectionResetError):
                self.disconnected.set()
                raise

        async def health(request: web.Request) -> web.Response:
            return web.Response()

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handle)
        app.router.add_get("/health", health)
        return app


async def sse_start(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp


async def forever() -> None:
    await asyncio.Event().wait()


def events_of(body: bytes) -> list[bytes]:
    """The stream's events; asserts it ends at an event boundary with exactly one [DONE]."""
    assert body.endswith(b"\n\n"), body[-80:]
    events = body[:-2].split(b"\n\n")
    assert events.count(b"data: [DONE]") == 1 and events[-1] == b"data: [DONE]"
    return events[:-1]


def error_events(events: list[bytes]) -> list[dict[str, Any]]:
    payloads = [orjson.loads(e.removeprefix(b"data: ")) for e in events]  # every event whole JSON
    return [p["error"] for p in payloads if "error" in p]


async def metric_lines(client: aiohttp.ClientSession, router_url: str, name: str) -> list[str]:
    text = await (await client.get(router_url + "/metrics")).text()
    return [line for line in text.splitlines() if line.startswith(name)]


async def wait_for_event(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), 10)


@pytest.fixture
def unanswered_connect_url() -> Iterator[str]:
    """A loopback port whose accept queue is full: new connections hang in SYN (connect timeout)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(s)
    yield f"http://127.0.0.1:{port}"
    for s in fillers:
        s.close()
    listener.close()


async def test_header_timeout_is_504_not_retried_and_keeps_the_replica_healthy(start_app, start_router):
    stalled = FakeUpstream(name="stalled", hold_before_headers=asyncio.Event())  # a very long queue
    good = FakeUpstream(name="good")
    stalled_url, good_url = await start_app(stalled.app()), await start_app(good.app())
    router, router_url = await start_router(
        [stalled_url, good_url], policy={"name": "round_robin"}, signals=QUIET,
        upstream={"header_timeout_s": 0.3, "max_attempts": 3})
    statuses, bodies = [], []
    async with aiohttp.ClientSession() as client:
        for i in range(4):  # round robin: half of them meet the stalled replica first
            async with client.post(router_url + "/v1/chat/completions",
                                   json={**CHAT, "stream": i % 2 == 0}) as resp:
                statuses.append(resp.status)
                bodies.append(await resp.read())
        errors = await metric_lines(client, router_url, "kvrouter_upstream_errors_total{")
        retries = await metric_lines(client, router_url, "kvrouter_upstream_retries_total{")
    assert sorted(statuses) == [200, 200, 504, 504]
    for status, body in zip(statuses, bodies):
        if status == 504:
            error = orjson.loads(body)["error"]
            assert error["code"] == 504 and "header_timeout_s" in error["message"]
    assert len(stalled.requests) == 2
    assert len(good.requests) == 2  # the timed-out requests were not run again elsewhere
    assert router.registry.healthy(stalled_url)  # failure_threshold 1, yet not marked down
    assert any('kind="header_timeout"' in line and stalled_url in line for line in errors)
    assert retries == []
    await wait_for_event(stalled.disconnected)  # the replica's request was aborted


async def test_refused_and_unanswered_connects_are_retried_and_count_against_health(
    start_app, start_router, closed_port_url, unanswered_connect_url
):
    good = FakeUpstream(name="good")
    good_url = await start_app(good.app())
    router, router_url = await start_router(
        [closed_port_url, unanswered_connect_url, good_url], policy={"name": "round_robin"},
        signals={**QUIET, "failure_threshold": 100},  # stays eligible: every request meets both
        upstream={"connect_timeout_s": 0.3, "header_timeout_s": 0.3, "max_attempts": 3})
    async with aiohttp.ClientSession() as client:
        for _ in range(3):
            async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        retries = await metric_lines(client, router_url, "kvrouter_upstream_retries_total{")
    assert len(good.requests) == 3
    assert any('reason="connect"' in line for line in retries)
    assert any('reason="connect_timeout"' in line for line in retries)
    assert router.registry._failures[closed_port_url] > 0
    assert router.registry._failures[unanswered_connect_url] > 0


async def test_idle_stream_ends_with_one_error_event_at_an_event_boundary(start_app, start_router):
    async def stall_mid_event(request: web.Request) -> web.StreamResponse:
        resp = await sse_start(request)
        await resp.write(chat_chunk(0) + chat_chunk(1))
        await resp.write(chat_chunk(2)[:20])  # half an event, then silence
        await forever()
        return resp

    replica = ScriptedReplica(stall_mid_event)
    replica_url = await start_app(replica.app())
    router, router_url = await start_router(
        [replica_url], signals=QUIET, upstream={"idle_timeout_s": 0.3, "max_attempts": 3})
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            body = await asyncio.wait_for(resp.read(), 10)
        errors = await metric_lines(client, router_url, "kvrouter_upstream_errors_total{")
    events = events_of(body)
    assert events[:2] == [chat_chunk(0)[:-2], chat_chunk(1)[:-2]]  # the half event never went out
    [error] = error_events(events)
    assert events[2].startswith(b'data: {"error"') and len(events) == 3
    assert error["code"] == 504 and "idle_timeout_s" in error["message"]
    assert any('kind="idle_timeout"' in line for line in errors)
    assert replica.requests == 1  # not retried
    assert router.registry.healthy(replica_url)
    await wait_for_event(replica.disconnected)


async def test_slow_but_steady_stream_outlives_the_idle_timeout(start_app, start_router):
    pieces = [chat_chunk(i) for i in range(10)] + [b"data: [DONE]\n\n"]

    async def drip(request: web.Request) -> web.StreamResponse:
        resp = await sse_start(request)
        for piece in pieces:  # half an event at a time, a steady 0.1 s apart
            half = len(piece) // 2
            for part in (piece[:half], piece[half:]):
                await resp.write(part)
                await asyncio.sleep(0.1)
        await resp.write_eof()
        return resp

    replica = ScriptedReplica(drip)
    _, router_url = await start_router(
        [await start_app(replica.app())], signals=QUIET, upstream={"idle_timeout_s": 0.5})
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            body = await asyncio.wait_for(resp.read(), 20)
    assert body == b"".join(pieces)  # 2 s of streaming against a 0.5 s idle timeout: complete


async def test_total_timeout_ends_a_steady_stream_with_one_error_event(start_app, start_router):
    async def endless(request: web.Request) -> web.StreamResponse:
        resp = await sse_start(request)
        i = 0
        while True:
            await resp.write(chat_chunk(i))
            i += 1
            await asyncio.sleep(0.02)

    replica = ScriptedReplica(endless)
    router, router_url = await start_router(
        [await start_app(replica.app())], signals=QUIET,
        upstream={"total_timeout_s": 0.6, "idle_timeout_s": 30})
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
            body = await asyncio.wait_for(resp.read(), 10)
        errors = await metric_lines(client, router_url, "kvrouter_upstream_errors_total{")
    [error] = error_events(events_of(body))
    assert error["code"] == 504 and "total_timeout_s" in error["message"]
    assert any('kind="total_timeout"' in line for line in errors)
    assert replica.requests == 1
    await wait_for_event(replica.disconnected)


async def test_idle_non_sse_bodies_504_when_buffered_and_abort_when_streamed(start_app, start_router):
    async def partial_buffered(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 100
        await resp.prepare(request)
        await resp.write(b'{"partial": ')
        await forever()
        return resp

    async def partial_chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b"x" * 1000)
        await forever()
        return resp

    buffered, streamed = ScriptedReplica(partial_buffered), ScriptedReplica(partial_chunked)
    cfg = {"signals": QUIET, "upstream": {"idle_timeout_s": 0.3}}
    _, buffered_router = await start_router([await start_app(buffered.app())], **cfg)
    _, streamed_router = await start_router([await start_app(streamed.app())], **cfg)
    async with aiohttp.ClientSession() as client:
        async with client.post(buffered_router + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 504
            error = (await resp.json())["error"]
            assert error["code"] == 504 and "idle_timeout_s" in error["message"]
        async with client.post(streamed_router + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):  # truncated, never passed off as whole
                await asyncio.wait_for(resp.read(), 10)
    await wait_for_event(buffered.disconnected)
    await wait_for_event(streamed.disconnected)


async def test_a_streamed_non_sse_body_that_stalls_before_its_first_byte_is_a_504(start_app, start_router):
    async def headers_only(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await forever()
        return resp

    replica = ScriptedReplica(headers_only)
    _, router_url = await start_router(
        [await start_app(replica.app())], signals=QUIET, upstream={"idle_timeout_s": 0.3})
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 504
            error = (await resp.json())["error"]
    assert error["code"] == 504 and "idle_timeout_s" in error["message"]
    await wait_for_event(replica.disconnected)


async def test_an_sse_event_that_never_ends_is_capped(start_app, start_router):
    async def endless_event(request: web.Request) -> web.StreamResponse:
        resp = await sse_start(request)
        await resp.write(chat_chunk(0))
        await resp.write(b"data: ")
        while True:  # no event boundary, ever: the router must not buffer all of it
            await resp.write(b"x" * 16384)

    replica = ScriptedReplica(endless_event)
    replica_url = await start_app(replica.app())
    router, router_url = await start_router(
        [replica_url], signals=QUIET, upstream={"max_sse_event_bytes": 65536})
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            body = await asyncio.wait_for(resp.read(), 10)
        errors = await metric_lines(client, router_url, "kvrouter_upstream_errors_total{")
    events = events_of(body)
    assert events[0] == chat_chunk(0)[:-2]
    [error] = error_events(events)
    assert len(events) == 2 and "max_sse_event_bytes" in error["message"]
    assert any('kind="sse_event_too_large"' in line for line in errors)
    await wait_for_event(replica.disconnected)
    assert router.registry.healthy(replica_url)
