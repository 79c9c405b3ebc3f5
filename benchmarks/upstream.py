"""A minimal SGLang-shaped upstream for data-plane benchmarks: no model time, just HTTP.

POST /v1/chat/completions answers a small JSON body, or with "stream": true, `chunks` SSE events
(each `chat.completion.chunk`) `interval_ms` apart, then `data: [DONE]`.
Run: python benchmarks/upstream.py PORT
"""

from __future__ import annotations

import asyncio
import sys

import orjson
from aiohttp import web

_COMPLETION = orjson.dumps({
    "id": "cmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
})


def _chunk(i: int) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "cmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "bench",
        "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
    }) + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    if not body.get("stream"):
        return web.Response(body=_COMPLETION, content_type="application/json")
    chunks = int(body.get("chunks", 20))
    interval = float(body.get("interval_ms", 0)) / 1000
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(chunks):
        await resp.write(_chunk(i))
        if interval:
            await asyncio.sleep(interval)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


def main() -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)


if __name__ == "__main__":
    main()
