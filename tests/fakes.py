"""A scriptable SGLang-shaped upstream for transport tests (a real aiohttp server on 127.0.0.1).

Each instance records what it received and what happened to each request, so tests can assert
on the upstream's view (headers seen, client disconnects observed, bytes sent).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


def chat_chunk(i: int, model: str = "fake-model") -> bytes:
    delta = {"role": "assistant", "content": ""} if i == 0 else {"content": f"tok{i} "}
    event = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(event) + b"\n\n"


def chat_completion(model: str = "fake-model") -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 1700000000,
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hello"},
             "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


@dataclass
class FakeUpstream:
    """Behaviour knobs are plain attributes a test flips between requests."""

    name: str = "fake"
    model: str = "fake-model"
    chunks: int = 5
    chunk_delay_s: float = 0.0
    status: int = 200  # e.g. 503 to force a retry
    hold_after_first: asyncio.Event | None = None  # stream waits here after chunk 0
    hold_before_headers: asyncio.Event | None = None  # every answer waits here (a long prefill)
    die_after_chunks: int | None = None  # abort the TCP connection after N chunks
    requests: list[dict[str, Any]] = field(default_factory=list)
    sent: list[bytes] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    # its own counts of inference requests: answered in full, cut short, answered with an error status
    completed: int = 0
    aborted: int = 0
    errors: int = 0

    @property
    def running(self) -> int:
        return len(self.requests) - self.completed - self.aborted - self.errors

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            app.router.add_post(path, self.handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.status < 500 else self.status)

    async def models(self, request: web.Request) -> web.Response:
        body = {"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "sglang", "max_model_len": 4096}]}
        return web.json_response(body)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        self.requests.append({"headers": {k.lower(): v for k, v in request.headers.items()}, "body": body, "raw": raw,
                              "path": request.path, "at": time.monotonic()})
        if self.hold_before_headers is not None:
            try:
                await self.hold_before_headers.wait()
            except asyncio.CancelledError:
                self.disconnected.set()
                self.aborted += 1
                raise
        if self.status != 200:
            self.errors += 1
            return web.json_response({"error": {"message": "busy", "code": self.status}},
                                     status=self.status)
        if not body.get("stream"):
            self.completed += 1
            return web.json_response(chat_completion(self.model), headers={"x-upstream": self.name})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "x-upstream": self.name})
        await resp.prepare(request)
        try:
            for i in range(self.chunks):
                if self.die_after_chunks is not None and i == self.die_after_chunks:
                    assert request.transport is not None
                    request.transport.abort()
                    self.aborted += 1
                    return resp
                data = chat_chunk(i, self.model)
                self.sent.append(data)
                await resp.write(data)
                if i == 0 and self.hold_after_first is not None:
                    await self.hold_after_first.wait()
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            self.sent.append(b"data: [DONE]\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.completed += 1
            self.finished.set()
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            self.aborted += 1
            raise
        return resp
