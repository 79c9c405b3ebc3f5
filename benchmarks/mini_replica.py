"""A minimal inference replica, deliberately unlike kvrouter's simulated SGLang replica.

It exists so a routing result does not rest on the project's own simulator: nothing here is
imported from kvrouter (only aiohttp and the standard library), the cache and the scheduler are
much simpler, and the timing constants are its own.

- Tokens: a prompt of ``B`` UTF-8 bytes is ``ceil(B / chars_per_token)`` tokens.
- Cache: a plain LRU of fixed-size pages (``--page-tokens``, default 32, i.e. ``page_tokens x
  chars_per_token`` bytes of the rendered prompt). Page ``i``'s key is a hash of page ``i - 1``'s key
  and page ``i``'s bytes, so a page matches only with the same whole prefix. A request hits the
  longest run of leading pages present; its prompt pages are then (re)inserted as most recently
  used. Only prompt pages are cached; output tokens hold KV while decoding and are freed after.
- Capacity: ``--max-total-tokens``. A request is admitted when its new prompt pages plus its output
  reservation fit beside the pages pinned by running requests (evicting unpinned pages, least
  recently used first); a request that could never fit gets a 400.
- Scheduler: FCFS, at most ``--max-batch`` running requests, no chunking. One engine loop in model
  time (``--time-scale`` model seconds per wall second): a waiting request's prefill runs alone and
  takes ``prefill_base_s + uncached tokens x prefill_s_per_token``; otherwise one decode step for
  all running requests takes ``decode_base_s + running x decode_s_per_seq`` (several steps are
  taken per wake-up, never past the next finish, to keep the CPU cost low).
- HTTP: ``POST /v1/chat/completions`` and ``/v1/completions`` (streaming or not; usage with
  ``prompt_tokens_details.cached_tokens``, in the stream's final event when
  ``stream_options.include_usage``), ``GET /health``, ``/v1/models``, ``POST /flush_cache`` (400
  while busy) and ``GET /metrics`` with SGLang's gauge names (``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage`` (pinned tokens / capacity),
  ``sglang:max_total_num_tokens``) so routers that read SGLang metrics can read these.

Run: python benchmarks/mini_replica.py --port 31000 [--max-total-tokens 300000] [--chars-per-token 4]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

# SGLang's metric names (copied strings: this replica shares no code with the project).
RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
TOKEN_USAGE = "sglang:token_usage"
MAX_TOTAL = "sglang:max_total_num_tokens"
CACHE_HIT_RATE = "sglang:cache_hit_rate"

OUTPUT_WORDS = "the quick brown fox jumps over a lazy dog and returns "
MAX_OUTPUT_RESERVE = 2048  # tokens of output reserved at admission, at most
DEFAULT_PAGE_TOKENS = 32
WAKE_WALL_S = 0.02  # engine wake-up granularity, wall seconds


@dataclass
class Timing:
    prefill_base_s: float = 0.030
    prefill_s_per_token: float = 45e-6
    decode_base_s: float = 0.018
    decode_s_per_seq: float = 0.0006


@dataclass(eq=False)
class Request:
    rid: int
    keys: list[bytes]
    prompt_tokens: int
    max_tokens: int
    submitted: float
    cached_tokens: int = 0
    generated: int = 0
    reserved_pages: int = 0
    pinned: bool = False  # holds its pages in the cache (admitted, not yet finished or aborted)
    done: bool = False
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class PageCache:
    """LRU of page keys with pins: pinned pages (used by a running request) are never evicted."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity = capacity_pages
        self.pages: OrderedDict[bytes, int] = OrderedDict()  # key -> pin count
        self.reserved = 0  # output pages of running requests
        self.pinned_pages = 0  # pages with a pin count above 0, kept as pins change (a scrape reads it)

    def hit_pages(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self.pages:
                break
            n += 1
        return n

    def pinned(self) -> int:
        return self.pinned_pages + self.reserved

    def try_admit(self, keys: list[bytes], reserve: int) -> bool:
        """Pin the request's pages (inserting the missing ones) if they fit, evicting LRU pages."""
        missing = [k for k in keys if k not in self.pages]
        free = self.capacity - len(self.pages) - self.reserved
        need = len(missing) + reserve - free
        if need > 0:
            own = set(keys)
            victims = list(itertools.islice((k for k, c in self.pages.items() if c == 0 and k not in own), need))
            if len(victims) < need:
                return False
            for k in victims:
                del self.pages[k]
        for k in keys:
            pins = self.pages.get(k, 0)
            if pins == 0:
                self.pinned_pages += 1
            self.pages[k] = pins + 1
            self.pages.move_to_end(k)
        self.reserved += reserve
        return True

    def release(self, keys: list[bytes], reserve: int) -> None:
        for k in keys:
            if k in self.pages:
                self.pages[k] -= 1
                if self.pages[k] == 0:
                    self.pinned_pages -= 1
        self.reserved -= reserve

    def flush(self) -> None:
        self.pages.clear()
        self.pinned_pages = 0


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.chars_per_token = args.chars_per_token
        self.page_tokens = args.page_tokens
        self.page_bytes = max(1, round(args.page_tokens * args.chars_per_token))
        self.capacity_tokens = args.max_total_tokens
        self.cache = PageCache(args.max_total_tokens // args.page_tokens)
        self.max_batch = args.max_batch
        self.time_scale = args.time_scale
        self.timing = Timing(args.prefill_base_s, args.prefill_s_per_token, args.decode_base_s,
                             args.decode_s_per_seq)
        self.waiting: list[Request] = []  # FCFS
        self.prefill: list[Request] = []  # admitted, not yet prefilled
        self.running: list[Request] = []  # decoding
        self.ids = itertools.count(1)
        self.wake = asyncio.Event()
        self.t0 = time.monotonic()
        self.hit_tokens = 0
        self.prompt_tokens_total = 0

    def now(self) -> float:
        return (time.monotonic() - self.t0) * self.time_scale

    def tokens(self, text: str) -> int:
        return math.ceil(len(text.encode()) / self.chars_per_token)

    def page_keys(self, data: bytes) -> list[bytes]:
        keys: list[bytes] = []
        prev = b""
        for start in range(0, len(data) - self.page_bytes + 1, self.page_bytes):
            prev = hashlib.blake2b(prev + data[start:start + self.page_bytes], digest_size=12).digest()
            keys.append(prev)
        return keys

    def submit(self, prompt: str, max_tokens: int) -> Request:
        data = prompt.encode()
        n = self.tokens(prompt)
        if n < 1:
            raise ValueError("the prompt is empty")
        reserve = -(-min(max_tokens, MAX_OUTPUT_RESERVE) // self.page_tokens)
        keys = self.page_keys(data)
        if len(keys) + 1 + reserve > self.cache.capacity:
            raise ValueError(f"the prompt ({n} tokens) and its output do not fit in the KV cache "
                             f"({self.capacity_tokens} tokens)")
        req = Request(next(self.ids), keys, n, max_tokens, self.now(), reserved_pages=reserve)
        self.waiting.append(req)
        self.wake.set()
        return req

    def abort(self, req: Request) -> None:
        for queue in (self.waiting, self.prefill, self.running):
            if req in queue:
                queue.remove(req)
        self._release(req)
        req.done = True

    def _release(self, req: Request) -> None:
        if req.pinned:
            req.pinned = False
            self.cache.release(req.keys, req.reserved_pages)

    def _admit(self) -> None:
        while self.waiting and len(self.prefill) + len(self.running) < self.max_batch:
            head = self.waiting[0]
            hit = self.cache.hit_pages(head.keys)
            if not self.cache.try_admit(head.keys, head.reserved_pages):
                return  # FCFS: nobody passes the head
            self.waiting.pop(0)
            head.pinned = True
            head.cached_tokens = min(hit * self.page_tokens, head.prompt_tokens)
            self.hit_tokens += head.cached_tokens
            self.prompt_tokens_total += head.prompt_tokens
            self.prefill.append(head)

    async def run(self) -> None:
        while True:
            self._admit()
            if self.prefill:
                req = self.prefill[0]  # listed through its pass: running, and the cache not flushable
                t = self.timing
                await self._pass(t.prefill_base_s + (req.prompt_tokens - req.cached_tokens) * t.prefill_s_per_token)
                if req in self.prefill:  # not aborted meanwhile
                    self.prefill.remove(req)
                    req.generated = 1
                    self._after_tokens(req)
            elif self.running:
                step = self.timing.decode_base_s + len(self.running) * self.timing.decode_s_per_seq
                left = min(r.max_tokens - r.generated for r in self.running)
                steps = max(1, min(left, int(WAKE_WALL_S * self.time_scale / step)))
                await self._pass(step * steps)
                for r in list(self.running):
                    r.generated += steps
                    self._after_tokens(r)
            else:
                self.wake.clear()
                await self.wake.wait()

    async def _pass(self, model_s: float) -> None:
        await asyncio.sleep(model_s / self.time_scale)

    def _after_tokens(self, req: Request) -> None:
        if req.generated >= req.max_tokens:
            req.generated = req.max_tokens
            req.done = True
            if req in self.running:
                self.running.remove(req)
            self._release(req)
        elif req not in self.running:
            self.running.append(req)
        req.changed.set()

    def output_text(self, start: int, end: int) -> str:
        a, b = int(start * self.chars_per_token), int(end * self.chars_per_token)
        reps = b // len(OUTPUT_WORDS) + 1
        return (OUTPUT_WORDS * reps)[a:b]

    def metrics(self) -> str:
        labels = '{model_name="mini"}'
        used = self.cache.pinned() * self.page_tokens / self.capacity_tokens
        rate = self.hit_tokens / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
        lines = []
        for name, value in ((RUNNING, len(self.running) + len(self.prefill)), (QUEUED, len(self.waiting)),
                            (TOKEN_USAGE, used), (MAX_TOTAL, self.capacity_tokens), (CACHE_HIT_RATE, rate)):
            lines += [f"# TYPE {name} gauge", f"{name}{labels} {value}"]
        return "\n".join(lines) + "\n"


ENGINE = web.AppKey("engine", Engine)


def _error(status: int, message: str) -> web.Response:
    body = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}
    return web.json_response(body, status=status)


def prompt_text(route: str, body: dict) -> str:
    """The text this replica tokenizes and caches: its own rendering of the chat messages."""
    if route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        parts = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"[{m.get('role', 'user')}]\n{content or ''}\n")
        return "".join(parts) + "[assistant]\n"
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError("prompt must be a string")
    return prompt


def _usage(req: Request) -> dict:
    return {"prompt_tokens": req.prompt_tokens, "completion_tokens": req.generated,
            "total_tokens": req.prompt_tokens + req.generated,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}


def _choice(route: str, text: str, finish: str | None, stream: bool) -> dict:
    if route == "completions":
        return {"index": 0, "text": text, "finish_reason": finish}
    key = "delta" if stream else "message"
    return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}


async def _serve(request: web.Request, route: str) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = json.loads(await request.read())
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        prompt = prompt_text(route, body)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 256)
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        req = engine.submit(prompt, max_tokens)
    except (ValueError, TypeError) as exc:
        return _error(400, str(exc))
    model = body.get("model") or "mini"
    obj = "text_completion" if route == "completions" else "chat.completion"
    base = {"id": f"mini-{req.rid}", "created": int(time.time()), "model": model}
    try:
        if not body.get("stream"):
            while not req.done:
                req.changed.clear()
                await req.changed.wait()
            text = engine.output_text(0, req.generated)
            return web.json_response({**base, "object": obj, "choices": [_choice(route, text, "length", False)],
                                      "usage": _usage(req)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk_obj = obj if route == "completions" else "chat.completion.chunk"
        sent = 0
        while True:
            if req.generated > sent or req.done:
                finish = "length" if req.done else None
                event = {**base, "object": chunk_obj,
                         "choices": [_choice(route, engine.output_text(sent, req.generated), finish, True)]}
                sent = req.generated
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                if req.done:
                    break
            req.changed.clear()
            if not req.done and req.generated == sent:
                await req.changed.wait()
        if (body.get("stream_options") or {}).get("include_usage"):
            event = {**base, "object": chunk_obj, "choices": [], "usage": _usage(req)}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        if not req.done:
            engine.abort(req)  # the client went away


async def chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions")


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "mini", "object": "model", "owned_by": "mini"}]})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[ENGINE].metrics(), content_type="text/plain")


async def flush_cache(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.waiting or engine.prefill or engine.running:
        return web.Response(status=400, text="Cache not flushed: requests are running or waiting.")
    engine.cache.flush()
    engine.hit_tokens = engine.prompt_tokens_total = 0
    return web.Response(text="Cache flushed.")


def build_app(args: argparse.Namespace) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[ENGINE] = Engine(args)

    async def start_engine(app: web.Application):  # type: ignore[no-untyped-def]
        task = asyncio.create_task(app[ENGINE].run())
        yield
        task.cancel()

    app.cleanup_ctx.append(start_engine)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/flush_cache", flush_cache)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    t = Timing()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-total-tokens", type=int, default=300_000, help="KV capacity in tokens")
    p.add_argument("--chars-per-token", type=float, default=4.0, help="prompt bytes per token")
    p.add_argument("--page-tokens", type=int, default=DEFAULT_PAGE_TOKENS)
    p.add_argument("--max-batch", type=int, default=16, help="running requests at most")
    p.add_argument("--time-scale", type=float, default=1.0, help="model seconds per wall second")
    p.add_argument("--prefill-base-s", type=float, default=t.prefill_base_s)
    p.add_argument("--prefill-s-per-token", type=float, default=t.prefill_s_per_token)
    p.add_argument("--decode-base-s", type=float, default=t.decode_base_s)
    p.add_argument("--decode-s-per-seq", type=float, default=t.decode_s_per_seq)
    args = p.parse_args(argv)
    if args.chars_per_token <= 0 or args.page_tokens < 1 or args.max_batch < 1 or args.time_scale <= 0:
        p.error("--chars-per-token, --page-tokens, --max-batch and --time-scale must be positive")
    if args.max_total_tokens < args.page_tokens:
        p.error("--max-total-tokens must hold at least one page")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    web.run_app(build_app(args), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
