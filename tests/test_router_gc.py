"""The router's long-lived state costs the cyclic garbage collector little.

A full collection walks every tracked container object and stops the event loop while it does.
The router keeps per-session state (affinity, prefix chains, body prefixes, the shadow index) for
thousands of sessions; kept as tracked objects per prompt block it would grow the heap every full
collection walks by thousands of objects per session. This counts the tracked objects a stream of
long, growing chat sessions leaves behind after a warm-up, against a stateless streaming replica.
"""

from __future__ import annotations

import gc

import aiohttp
import orjson
from aiohttp import web

from kvrouter.loadtest.turn_request import synthetic_text

SESSION_TURNS = 3
PROMPT_TOKENS = 5_000  # 20 KB per turn: ~80 blocks of the shadow index


def _replica() -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": None}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [],
                 "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
        return resp

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text='sglang:num_running_reqs{model_name="m"} 0\n', content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    return app


async def _sessions(http: aiohttp.ClientSession, url: str, first: int, count: int) -> None:
    for s in range(first, first + count):
        messages = [{"role": "system", "content": synthetic_text("system", 500)}]
        for turn in range(SESSION_TURNS):
            messages.append({"role": "user", "content": synthetic_text(f"{s}:{turn}", PROMPT_TOKENS)})
            body = {"model": "m", "messages": messages, "max_tokens": 4, "stream": True}
            async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                                 headers={"content-type": "application/json", "x-session-id": f"s{s}"}) as resp:
                assert resp.status == 200
                await resp.read()
            messages.append({"role": "assistant", "content": "ok"})


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


async def test_sessions_leave_few_tracked_objects_per_session(start_app, start_router) -> None:
    replicas = [await start_app(_replica()) for _ in range(2)]
    _, url = await start_router(replicas, routing={"shadow": ["prefix-aware"]})
    sessions = 30
    async with aiohttp.ClientSession() as http:
        await _sessions(http, url, 0, 10)  # warm-up: connection pools, lazily built parts
        before = _tracked()
        await _sessions(http, url, 10, sessions)
        after = _tracked()
    per_session = (after - before) / sessions
    # ~10 today (session entry, prefix chain, body prefix, shadow run and their lists and sets);
    # a tracked object per block (~240 per session here) would show at once
    assert per_session < 60, per_session
