"""A served prompt is in the KV index before the replica's reported usage is learnt from it,
however the answer's bytes arrive (the learner compares the usage with what the index holds)."""

from __future__ import annotations

import asyncio

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


async def test_a_stream_is_recorded_while_the_replica_prefills(start_app, start_router):
    """SGLang sends a stream's headers at once and its first token after the prefill: the prompt
    is in the index during that wait (as the simulator has it from when the replica takes the
    request), so a request sharing its prefix placed meanwhile finds it there."""
    first_token = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # the head goes out now
        await first_token.wait()
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n')
        await resp.write_eof(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    replica = await start_app(app)
    router, router_url = await start_router([replica], signals={"interval_s": 60})
    index = router.engine.index
    async with ClientSession() as client:

        async def ask() -> bytes:
            async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                return await resp.read()

        answer = asyncio.ensure_future(ask())
        try:
            deadline = asyncio.get_running_loop().time() + 5
            while not index.held_blocks(replica):  # the replica is still prefilling
                assert asyncio.get_running_loop().time() < deadline, "not recorded during the prefill"
                assert not answer.done()
                await asyncio.sleep(0.01)
            assert not answer.done()
        finally:
            first_token.set()
        assert (await asyncio.wait_for(answer, 5)).endswith(b"data: [DONE]\n\n")
