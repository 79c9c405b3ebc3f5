"""A stream's first-byte records (the TTFB metric, Placement.first_byte) are made exactly once
on the paths that do not write the first bytes on their own: the whole body arriving with the
head (it goes out with the response's end), and a replica breaking before a whole event was
written. A decision's notes, worked out after the request is sent, are made once per attempt and
never cost the request its answer."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import ClientSession, web

from kvrouter.router.engine import RoutingEngine

from .test_first_byte_order import CHAT, TOKEN, _lines, _logged_router, _record_order, _ttfb_count


def _app(handle) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    return app


async def test_a_whole_stream_that_came_with_its_head_records_its_first_byte_once(
        start_app, start_router, monkeypatch):
    events = _record_order(monkeypatch)

    async def whole(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=TOKEN + b"data: [DONE]\n\n", content_type="text/event-stream")

    replica = await start_app(_app(whole))
    router, url = await start_router([replica], signals={"interval_s": 60})
    async with ClientSession() as client:
        async with client.post(url + "/v1/chat/completions", json=CHAT) as resp:
            assert (await resp.read()) == TOKEN + b"data: [DONE]\n\n"
    assert events == ["first_byte"]  # it went out with the end (write_eof), not by a write
    assert _ttfb_count(router, replica) == 1


async def test_a_replica_breaking_before_a_whole_event_records_the_first_byte_once(
        start_app, start_router, monkeypatch):
    events = _record_order(monkeypatch)

    async def half_event(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choi')  # no event end: nothing for the router to relay yet
        request.transport.close()  # the chunked body ends without its terminator
        return resp

    replica = await start_app(_app(half_event))
    router, url = await start_router([replica], signals={"interval_s": 60})
    async with ClientSession() as client:
        async with client.post(url + "/v1/chat/completions", json=CHAT) as resp:
            body = await resp.read()
    assert b"failed mid-stream" in body
    assert events.count("first_byte") == 1 and _ttfb_count(router, replica) == 1


async def test_a_retried_request_works_out_each_attempts_notes_once(start_app, start_router, tmp_path: Path):
    refused: list[str] = []  # the fleet refuses its first request (whichever replica gets it)

    async def busy_once(request: web.Request) -> web.StreamResponse:
        await request.read()
        if not refused:
            refused.append(request.host)
            return web.json_response({"error": "busy"}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write_eof(TOKEN + b"data: [DONE]\n\n")
        return resp

    replicas = [await start_app(_app(busy_once)) for _ in range(2)]
    path = tmp_path / "decisions.jsonl"
    router, url = await start_router(replicas, signals={"interval_s": 60},
                                     observability={"decision_log": str(path)},
                                     routing={"shadow": ["consistent-hash"]})
    async with ClientSession() as client:
        for _ in range(2):
            async with client.post(url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                await resp.read()
    lines = await _lines(path, 2)
    assert [line["attempts"] for line in lines] == [2, 1]
    for line in lines:  # the line carries its last attempt's notes
        assert line["status"] == 200 and line["replica"] in replicas
        assert line["predicted_ttft_s"] is not None and "consistent-hash" in line["shadow"]
    router.metrics.render()
    shadowed = sum(router.metrics.registry.get_sample_value(
        "kvrouter_shadow_decisions_total", {"shadow": "consistent-hash", "agrees": a}) or 0.0
        for a in ("true", "false"))
    assert shadowed == 3  # once per attempt, none lost or doubled


async def test_notes_that_fail_cost_the_request_nothing(start_app, start_router, monkeypatch,
                                                        tmp_path: Path):
    def broken(self, *args, **kwargs):
        raise RuntimeError("a bug in a shadow policy")

    monkeypatch.setattr(RoutingEngine, "notes", broken)
    release_now = asyncio.Event()
    release_now.set()
    path = tmp_path / "decisions.jsonl"
    _, url, replica = await _logged_router(start_app, start_router, path, release_now,
                                           routing={"shadow": ["consistent-hash"]})
    async with ClientSession() as client:
        async with client.post(url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    (line,) = await _lines(path, 1)
    assert line["status"] == 200 and line["replica"] == replica and "shadow" not in line
