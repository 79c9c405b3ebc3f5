"""The exact-KV tokenizer runs off the event loop, in a bounded pool: routing still finds the
exact prefix match through it, and a full pool routes without the match instead of waiting."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import aiohttp

from kvrouter.loadtest import tokenizer
from kvrouter.loadtest.sim_prompt import kv_token_ids
from kvrouter.router.kv_index_exact import request_blocks
from kvrouter.router.tokenizers import TokenizePool

from .kv_cluster import PS, kv_cluster, post



async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def blocks(body: dict) -> tuple[int, ...]:
    return request_blocks(kv_token_ids, "/v1/chat/completions", body, PS)[1]


async def warm_elsewhere(s: aiohttp.ClientSession, router, replica: str, seed: int) -> dict:
    """A conversation prefilled directly on `replica`; returns its keyless continuation."""
    warm = [{"role": "user", "content": "Review:\n" + tokenizer.synthetic_text(400, seed)}]
    _, w = await post(s, replica, {"model": "tiny", "messages": warm, "max_tokens": 20})
    follow = {"model": "tiny", "max_tokens": 5, "messages": warm + [
        {"role": "assistant", "content": w["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Thanks."}]}
    await wait_for(lambda: router.index.match(blocks(follow)).get(replica, 0)
                   >= w["usage"]["prompt_tokens"] - PS)
    return follow


async def test_exact_match_routing_goes_through_the_pool(start_app, start_router):
    router, base, urls = await kv_cluster(start_app, start_router, tokenizer_threads=1)
    assert router.tokenize_pool is not None
    threads: list[str] = []
    fn = router.tokenize_pool.fn

    def recording(route: str, body: dict[str, Any]):
        threads.append(threading.current_thread().name)
        return fn(route, body)

    router.tokenize_pool.fn = recording
    affinity = router.metrics.decisions.labels("coding_agent", "affinity")
    async with aiohttp.ClientSession() as s:
        for seed, replica in ((3, urls[1]), (4, urls[0])):
            follow = await warm_elsewhere(s, router, replica, seed)
            before = (router.metrics.flush() or affinity._value.get())
            served, _ = await post(s, base, follow)
            assert served == replica  # placed where its prefix lives, by the exact index
            assert (router.metrics.flush() or affinity._value.get()) == before + 1
    assert threads and all(t.startswith("kvrouter-tokenize") for t in threads)
    assert router.metrics.tokenizer_overflow._value.get() == 0


async def test_full_pool_routes_without_the_exact_match(start_app, start_router):
    router, base, urls = await kv_cluster(start_app, start_router, tokenizer_threads=1,
                                          tokenizer_queue=0)
    pool = router.tokenize_pool
    assert pool is not None
    fn = pool.fn
    release = threading.Event()
    started = threading.Event()

    def stuck(route: str, body: dict[str, Any]):
        started.set()
        release.wait(30)
        return fn(route, body)

    async with aiohttp.ClientSession() as s:
        follow = await warm_elsewhere(s, router, urls[1], 5)
        later = await warm_elsewhere(s, router, urls[1], 6)  # untouched by the overflow below
        pool.fn = stuck
        try:
            first = asyncio.create_task(post(s, base, {"model": "tiny", "max_tokens": 1,
                                                       "messages": [{"role": "user", "content": "a"}]}))
            await wait_for(started.is_set)  # the only thread is taken, and no queue slot exists
            pool.fn = fn
            # Answered at once, without waiting for the pool and without exact-match information.
            _, out = await asyncio.wait_for(post(s, base, follow), 5)
            assert out["choices"]
            assert router.metrics.tokenizer_overflow._value.get() == 1
        finally:
            release.set()
        await first
        # The pool is free again: exact matches are back.
        affinity = router.metrics.decisions.labels("coding_agent", "affinity")
        before = (router.metrics.flush() or affinity._value.get())
        served, _ = await post(s, base, later)
        assert served == urls[1]
        assert (router.metrics.flush() or affinity._value.get()) == before + 1


async def test_pool_answers_none_when_full_and_frees_its_slots():
    gate = threading.Event()
    full: list[int] = []
    pool: TokenizePool[int] = TokenizePool(lambda r, b: (gate.wait(10), 7)[1], threads=1, queue=1,
                                           on_full=lambda: full.append(1))
    try:
        a = asyncio.create_task(pool.run("/generate", {}))
        b = asyncio.create_task(pool.run("/generate", {}))
        await asyncio.sleep(0)  # both admitted (one running, one queued)
        assert await pool.run("/generate", {}) is None and full == [1]
        gate.set()
        assert await a == 7 and await b == 7
        assert await pool.run("/generate", {}) == 7  # slots came back
    finally:
        pool.close()
