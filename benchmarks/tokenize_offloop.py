"""Event-loop lag while the exact-KV tokenizer works on large prompts: on the loop vs in the pool.

Three routers with `kv_events.enabled` and the simulated replica's tokenizer
(`kvrouter.loadtest.sim_prompt:kv_token_ids`, pure Python like most chat-template code):
`tokenizer_threads: 0` (tokenized on the event loop, as before the pool), 1 (the default) and 2.
Each computes request summaries (`Handlers.summarize_request`, the request path's call) for large
chat prompts, a few concurrently, while a 1 ms ticker on the same uvloop loop records how late it
wakes. Rounds alternate the modes' order (forward, reversed) so machine noise hits all of them. Prints p50/p99/max lag
and the summaries' throughput, side by side.

    python benchmarks/tokenize_offloop.py [--prompt-kb 400] [--requests 24] [--concurrency 4]
                                          [--rounds 3] [--json docs/benchmarks-tokenize.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import uvloop  # noqa: E402

from kvrouter.loadtest import tokenizer  # noqa: E402
from kvrouter.router.app import Router  # noqa: E402
from kvrouter.router.config import parse_config  # noqa: E402

ROUTE = "/v1/chat/completions"
TICK_S = 0.001
MODES = {"on-loop": 0, "pool-1": 1, "pool-2": 2}  # kv_events.tokenizer_threads (1: default)


def make_router(threads: int) -> Router:
    return Router(parse_config({
        "replicas": ["http://127.0.0.1:9"],  # never contacted: only summaries are computed
        "kv_events": {"enabled": True, "page_size": 64, "tokenizer_threads": threads,
                      "tokenizer": "kvrouter.loadtest.sim_prompt:kv_token_ids"},
    }))


def make_prompts(kb: int, count: int) -> list[dict[str, Any]]:
    tokens = kb * 1024 // 4  # synthetic text runs ~4 characters per token
    return [{"model": "tiny", "messages": [
        {"role": "system", "content": f"Agent {i}."},
        {"role": "user", "content": tokenizer.synthetic_text(tokens, i + 1)}]}
        for i in range(count)]


async def one_block(router: Router, prompts: list[dict[str, Any]], requests: int,
                    concurrency: int) -> tuple[list[float], float, int]:
    """(ticker lags in seconds, wall seconds, exact summaries) for `requests` summaries."""
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append(max(0.0, time.perf_counter() - t - TICK_S))

    exact = 0

    async def worker(k: int) -> None:
        nonlocal exact
        for i in range(k, requests, concurrency):
            summary = await router.handlers.summarize_request(ROUTE, prompts[i % len(prompts)], {})
            exact += bool(summary.prefix_blocks)
            await asyncio.sleep(0)  # each request is its own task in the server: they interleave

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)  # the ticker is running
    started = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    wall = time.perf_counter() - started
    stop.set()
    await tick
    return lags, wall, exact


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = make_prompts(args.prompt_kb, 8)
    routers = {mode: make_router(threads) for mode, threads in MODES.items()}
    lags: dict[str, list[float]] = {m: [] for m in MODES}
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    exact: dict[str, int] = {m: 0 for m in MODES}
    try:
        for mode, router in routers.items():  # warm-up: imports, first thread start
            await one_block(router, prompts, 2, 1)
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))  # noise hits all
            for mode in order:
                block_lags, wall, n = await one_block(routers[mode], prompts, args.requests,
                                                      args.concurrency)
                lags[mode] += block_lags
                walls[mode].append(wall)
                exact[mode] += n
    finally:
        for router in routers.values():
            if router.tokenize_pool is not None:
                router.tokenize_pool.close()
    out: dict[str, Any] = {}
    for mode in MODES:
        summaries = args.requests * args.rounds
        out[mode] = {
            "tokenizer_threads": MODES[mode],
            "ticks": len(lags[mode]),
            "lag_p50_ms": round(pct(lags[mode], 0.50) * 1e3, 3),
            "lag_p99_ms": round(pct(lags[mode], 0.99) * 1e3, 3),
            "lag_max_ms": round(max(lags[mode]) * 1e3, 3),
            "summaries": summaries,
            "exact_summaries": exact[mode],
            "summaries_per_s": round(summaries / sum(walls[mode]), 2),
            "block_wall_s_median": round(statistics.median(walls[mode]), 3),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-kb", type=int, default=400)
    parser.add_argument("--requests", type=int, default=24, help="summaries per mode and round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = uvloop.run(run(args))
    print(f"{'mode':<10} {'threads':>7} {'ticks':>6} {'lag p50 ms':>11} {'p99 ms':>8} "
          f"{'max ms':>8} {'summaries/s':>12} {'exact':>6}")
    for mode, r in results.items():
        print(f"{mode:<10} {r['tokenizer_threads']:>7} {r['ticks']:>6} {r['lag_p50_ms']:>11.3f} "
              f"{r['lag_p99_ms']:>8.3f} {r['lag_max_ms']:>8.3f} {r['summaries_per_s']:>12.2f} "
              f"{r['exact_summaries']:>6}")
    if args.json is not None:
        record = {
            "command": "python benchmarks/tokenize_offloop.py " + " ".join(sys.argv[1:]),
            "prompt_kb": args.prompt_kb, "requests_per_round": args.requests,
            "concurrency": args.concurrency, "rounds": args.rounds,
            "tokenizer": "kvrouter.loadtest.sim_prompt:kv_token_ids", "tick_ms": TICK_S * 1e3,
            "results": results,
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
