"""Token ids of a request, for the exact KV index: pluggable, because only the deployment knows
its model's chat template and tokenizer.

A tokenizer plug-in is any function `(route, body) -> list[int] | None` returning the token ids
the engine will prefill for that request (None when it cannot tell), named in the config as
`kv_events.tokenizer: module:function`. With Hugging Face, for example:

    tok = AutoTokenizer.from_pretrained("moonshotai/Kimi-K2-Instruct")
    def token_ids(route, body):
        if route == "/v1/chat/completions":
            return tok.apply_chat_template(body["messages"], tools=body.get("tools"),
                                           add_generation_prompt=True, tokenize=True)
        return input_ids(route, body)

It runs for every request in a small thread pool (`kv_events.tokenizer_threads`, see
:class:`TokenizePool`), so it must be thread-safe; a large prompt then no longer stalls the event
loop (a pure-Python tokenizer still holds the GIL, but hands it back every few milliseconds).
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

Tokenizer = Callable[[str, dict[str, Any]], "list[int] | None"]
T = TypeVar("T")


def input_ids(route: str, body: dict[str, Any]) -> list[int] | None:
    """The default: token ids only when the client sent them (`/generate` `input_ids`)."""
    ids = body.get("input_ids") if route == "/generate" else None
    if isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < 2**32 for t in ids):
        return ids
    return None


def load_tokenizer(path: str) -> Tokenizer:
    """Import `module:function`; ValueError (naming the path) if that fails."""
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import tokenizer {path!r}: {err}") from None
    if not callable(fn):
        raise ValueError(f"tokenizer {path!r} is not callable")
    return fn


class TokenizePool(Generic[T]):
    """Runs `fn(route, body)` (tokenize and hash a request) on a few threads, with room for
    `queue` more requests waiting. When all of it is taken, :meth:`run` answers None at once
    (as a tokenizer that cannot tell would) and calls `on_full`: a flood of large prompts costs
    prefix information, never an unbounded pile of work or a waiting request."""

    def __init__(self, fn: Callable[[str, dict[str, Any]], T | None], threads: int, queue: int,
                 on_full: Callable[[], None] = lambda: None) -> None:
        self.fn = fn
        self.on_full = on_full
        self._slots = threading.BoundedSemaphore(threads + queue)  # released by the worker
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kvrouter-tokenize")

    async def run(self, route: str, body: dict[str, Any]) -> T | None:
        """`fn`'s answer, or None when the pool is full. The body must not change meanwhile."""
        if not self._slots.acquire(blocking=False):
            self.on_full()
            return None
        try:
            job: Future[T | None] = self._executor.submit(self.fn, route, body)
        except RuntimeError:  # shut down
            self._slots.release()
            return None
        job.add_done_callback(lambda _: self._slots.release())  # also when it never started
        return await asyncio.wrap_future(job)

    def close(self) -> None:
        """Drop waiting jobs; running ones finish in their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)
