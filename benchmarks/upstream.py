"""A minimal SGLang-shaped upstream for data-plane benchmarks: no model time, just HTTP.

POST /v1/chat/completions answers a small JSON body, or with "stream": true, `max_tokens` SSE events
(each `chat.completion.chunk`, carrying `"t"`: the upstream's CLOCK_MONOTONIC in ns when it was
written, so a client on the same host can measure per-chunk delivery latency)
`metadata.interval_ms` apart, then `data: [DONE]`. With `--first-event-ms`, the first event comes
that long after the response headers, as a replica's prefill would delay it.

Three HTTP stacks serve the same bytes:
- `uvicorn` (default when installed): FastAPI on uvicorn with uvloop + httptools, SGLang's own
  HTTP stack (`ORJSONResponse` / `StreamingResponse`, `timeout_keep_alive=5`, as its http_server);
- `aiohttp`: an aiohttp web app;
- `raw`: non-streaming only, an asyncio protocol answering each request with prebuilt bytes.
  It costs a fraction of the others' CPU, so a router in front of it is the bottleneck (the
  --workers scaling section needs that on a 2-core machine).

Run: python benchmarks/upstream.py PORT [--server uvicorn|aiohttp|raw] [--max-total-num-tokens N] [--first-event-ms MS]
"""


import argparse
import asyncio
import time
from collections.abc import AsyncIterator

import orjson

COMPLETION = orjson.dumps({
    "id": "cmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
})
DONE = b"data: [DONE]\n\n"
_HEAD = (b'data: {"id":"cmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench",'
         b'"choices":[{"index":0,"delta":{"content":"t')


def chunk(i: int) -> bytes:
    """One SSE event, ~190 bytes like an SGLang token chunk."""
    return (_HEAD + b"%d \"},\"finish_reason\":null}],\"t\":%d}\n\n" % (i, time.monotonic_ns()))


def stream_params(body: dict) -> tuple[int, float]:
    """Chunks from `max_tokens` (or `max_completion_tokens`), pacing from `metadata.interval_ms`:
    standard OpenAI fields, which routers that re-serialise requests (the SGLang gateway) keep."""
    chunks = body.get("max_tokens") or body.get("max_completion_tokens") or 20
    meta = body.get("metadata") or {}
    return int(chunks), float(meta.get("interval_ms", 0)) / 1000


FIRST_EVENT_S = 0.0  # the pause between the headers and the first event (--first-event-ms)


async def events(chunks: int, interval: float) -> AsyncIterator[bytes]:
    if FIRST_EVENT_S:
        await asyncio.sleep(FIRST_EVENT_S)
    for i in range(chunks):
        yield chunk(i)
        if interval:
            await asyncio.sleep(interval)
    yield DONE


def metrics_text(max_total_num_tokens: int) -> bytes:
    """A /metrics page reporting only the KV capacity, as SGLang emits it at start-up."""
    from kvrouter.sglang_protocol.metric_names import MAX_TOTAL_NUM_TOKENS, prefixed

    name = prefixed(MAX_TOTAL_NUM_TOKENS)
    return f'# TYPE {name} gauge\n{name}{{model_name="bench"}} {max_total_num_tokens}\n'.encode()


def aiohttp_app(max_total_num_tokens: int | None = None):  # type: ignore[no-untyped-def]
    from aiohttp import web

    async def chat(request: "web.Request") -> "web.StreamResponse":
        body = orjson.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=COMPLETION, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async for data in events(*stream_params(body)):
            await resp.write(data)
        await resp.write_eof()
        return resp

    async def health(request: "web.Request") -> "web.Response":
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    if max_total_num_tokens:
        page = metrics_text(max_total_num_tokens)

        async def metrics(request: "web.Request") -> "web.Response":
            return web.Response(body=page, content_type="text/plain")

        app.router.add_get("/metrics", metrics)
    return app


def fastapi_app():  # type: ignore[no-untyped-def]
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):  # type: ignore[no-untyped-def]
        body = orjson.loads(await request.body())
        if not body.get("stream"):
            return Response(content=COMPLETION, media_type="application/json")
        return StreamingResponse(events(*stream_params(body)), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> Response:
        return Response(content=b"")

    return app


def _raw_response(status: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (status, len(body), body))


async def raw_server(port: int) -> None:
    import httptools

    completion = _raw_response(b"200 OK", COMPLETION)
    health = _raw_response(b"200 OK", b"")
    not_found = _raw_response(b"404 Not Found", b'{"detail":"Not Found"}')

    class RawHTTP(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.url = b""

        def on_url(self, url: bytes) -> None:
            self.url = url

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def on_message_complete(self) -> None:
            if self.parser.get_method() == b"POST":
                answer = completion
            else:
                answer = health if self.url == b"/health" else not_found
            self.transport.write(answer)  # type: ignore[attr-defined]
            if not self.parser.should_keep_alive():
                self.transport.close()

    server = await asyncio.get_running_loop().create_server(RawHTTP, "127.0.0.1", port)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description="SGLang-shaped benchmark upstream")
    parser.add_argument("port", type=int)
    parser.add_argument("--server", choices=("uvicorn", "aiohttp", "raw"), default="aiohttp")
    parser.add_argument("--max-total-num-tokens", type=int,
                        help="aiohttp only: serve /metrics reporting this KV capacity (else no /metrics)")
    parser.add_argument("--first-event-ms", type=float, default=0.0,
                        help="streams: pause this long between the headers and the first event")
    args = parser.parse_args()
    global FIRST_EVENT_S
    FIRST_EVENT_S = args.first_event_ms / 1000
    if args.server == "uvicorn":
        import uvicorn

        uvicorn.run(fastapi_app(), host="127.0.0.1", port=args.port, loop="uvloop",
                    http="httptools", log_level="warning", access_log=False, timeout_keep_alive=5)
        return
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    if args.server == "raw":
        asyncio.run(raw_server(args.port))
        return
    from aiohttp import web

    web.run_app(aiohttp_app(args.max_total_num_tokens), host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
