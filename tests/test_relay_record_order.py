"""A served prompt is in the KV index before the replica's reported usage is learnt from it,
however the answer's bytes arrive (the learner compares the usage with what the index holds)."""

from __future__ import annotations

import orjson
from aiohttp import ClientSession, web

CHAT = {"model": "fake-model", "stream": True,
        "messages": [{"role": "user", "content": "x" * 20_000}]}


def _one_read_stream_app() -> web.Application:
    """A replica whose whole stream (a token, its usage, the end) goes out in one write."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        token = {"id": "c", "object": "chat.completion.chunk", "model": "fake-model",
                 "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
        usage = {"id": "c", "object": "chat.completion.chunk", "model": "fake-model", "choices": [],
                 "usage": {"prompt_tokens": 5000, "completion_tokens": 1,
                           "prompt_tokens_details": {"cached_tokens": 0}}}
        body = b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in (token, usage))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write_eof(body + b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    return app


async def test_a_stream_read_in_one_piece_is_recorded_before_its_usage_is_learnt(
        start_app, start_router, monkeypatch):
    replica = await start_app(_one_read_stream_app())
    router, router_url = await start_router([replica], signals={"interval_s": 60})
    index, learner = router.engine.index, router.engine.learner
    held_when_learnt: list[int] = []
    observe = learner.observe

    def watched_observe(url, *args, **kwargs):
        held_when_learnt.append(len(index.held_blocks(url)))
        return observe(url, *args, **kwargs)

    monkeypatch.setattr(learner, "observe", watched_observe)
    async with ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            body = await resp.read()
    assert body.endswith(b"data: [DONE]\n\n") and b'"choices":[]' not in body  # asked for, dropped
    assert held_when_learnt and held_when_learnt[0] > 0
    assert len(index.held_blocks(replica)) == held_when_learnt[0]
