"""CPU per Redis call: redis-py's asyncio client vs the affinity store's pipelined connection.

Both run the same EVALSHA (the store's acquire script, on a real Redis-protocol server started
here) in the same process under uvloop, alone (1 caller) and with 16 concurrent callers, in
alternating blocks so machine noise hits both. Prints CPU and wall microseconds per call.

    python benchmarks/redis_calls.py [--calls 4000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import redis.asyncio as aioredis  # noqa: E402
from portable import portable_command  # noqa: E402

from kvrouter.router.affinity_lua import GET as _GET  # noqa: E402
from kvrouter.router.affinity_lua import BucketKeys  # noqa: E402
from kvrouter.router.redis_pipe import PipelinedRedis, Script  # noqa: E402
from tests.redis_server import RedisProcess  # noqa: E402

_BUCKET = BucketKeys("bench:", 1)
KEYS = [_BUCKET.session("session"), _BUCKET.routers[0], _BUCKET.lru[0]]
ARGS = [10_000, 3600, 1_000_000, "router-1"]  # lease ms, ttl s, cap, router id: counts like acquire


async def _block(call: Any, calls: int, concurrency: int) -> tuple[float, float]:
    async def worker() -> None:
        for _ in range(calls // concurrency):
            await call()

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ((time.process_time() - cpu) / calls * 1e6, (time.perf_counter() - wall) / calls * 1e6)


async def measure(url: str, calls: int, rounds: int) -> dict[str, Any]:
    client = aioredis.Redis.from_url(url, socket_timeout=0.25, socket_connect_timeout=0.25,
                                     retry_on_timeout=False, health_check_interval=0)
    script = client.register_script(_GET)
    pipe = PipelinedRedis(url, timeout=0.25)
    pipe_script = Script(_GET)
    clients = {
        "redis-py": lambda: script(keys=KEYS, args=ARGS),
        "pipelined": lambda: pipe.evalsha(pipe_script, KEYS, ARGS),
    }
    samples: dict[str, dict[int, list[tuple[float, float]]]] = {n: {1: [], 16: []} for n in clients}
    try:
        for call in clients.values():
            await call()  # load the script, open connections
        for r in range(rounds):
            order = list(clients) if r % 2 == 0 else list(reversed(clients))
            for concurrency in (1, 16):
                for name in order:
                    samples[name][concurrency].append(await _block(clients[name], calls, concurrency))
    finally:
        await client.aclose()
        await pipe.aclose()
    return {name: {f"c{c}": {"cpu_us_per_call": statistics.median(s[0] for s in runs),
                             "wall_us_per_call": statistics.median(s[1] for s in runs),
                             "runs": runs}
                   for c, runs in per.items()}
            for name, per in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000, help="calls per block")
    parser.add_argument("--rounds", type=int, default=3, help="alternating blocks per client")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    server = RedisProcess(Path(tempfile.mkdtemp(prefix="redis-calls-")))
    server.start()
    try:
        import uvloop

        result = uvloop.run(measure(server.url, args.calls, args.rounds))
    finally:
        server.kill()
    for name, per in result.items():
        print(f"{name:10} " + "  ".join(
            f"{c}: CPU {v['cpu_us_per_call']:.1f} us/call, wall {v['wall_us_per_call']:.1f}"
            for c, v in per.items()))
    for c in ("c1", "c16"):
        print(f"redis-py / pipelined CPU per call, {c}: "
              f"{result['redis-py'][c]['cpu_us_per_call'] / result['pipelined'][c]['cpu_us_per_call']:.1f}x")
    if args.json:
        out = {"command": portable_command(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"), **result}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
