"""Cache-hit rate with several router processes against one, on the compare workload.

    python benchmarks/workers_cache.py [--replicas 4] [--users 24] [--duration 40] \
        [--time-scale 5] [--rounds 2] [--json docs/benchmarks-workers-cache.json]

One fleet of simulated replicas and one Redis for the whole run. For every setup, with and
without session keys (the driver's `x-session-id` header on or off): flush the replicas'
caches, start the router(s), replay the identical seeded workload (`kvrouter compare`'s: warm
start, ramp, warm-up left out), stop them. `--rounds N` runs every setup N times, the setups
interleaved, since one run's cache-hit rate varies by several points with timing alone. Every setup uses `affinity.store: redis`, so only
the number of router processes and the index sharing differ:

- `one-process`: one `kvrouter serve`;
- `workers-2`: `kvrouter serve --workers 2` (SO_REUSEPORT: the kernel spreads the driver's
  connections over both, so a session's turns land on either);
- `workers-2-unshared`: the same with `affinity.share_routing_state: false`, each worker's index
  and session table learning only from its own requests (the behaviour before they were shared);
- `workers-2-own-in-flight`: `--workers 2` sharing the index and session table but not the
  requests in flight (`affinity.share_in_flight: false`): each worker's load view counts its own
  dispatches and the replicas' polled counts only;
- `two-routers`: two `kvrouter serve` processes on two ports sharing the Redis, the driver
  sending requests round robin over them (a load balancer in front of two pods).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests/ (its Redis server)
from portable import portable_command  # noqa: E402
from kvrouter.loadtest.compare import _flush  # noqa: E402
from kvrouter.loadtest.driver import run_load  # noqa: E402
from kvrouter.loadtest.process_group import ProcessGroup, RunningProcess, free_port, wait_ready  # noqa: E402
from kvrouter.loadtest.workload_config import load_workload  # noqa: E402

SETUPS = ("one-process", "workers-2", "workers-2-unshared", "workers-2-own-in-flight", "two-routers")
KEPT = ("cache_hit_rate", "requests_ok", "requests_failed", "ttft_p50_s", "ttft_p95_s",
        "load_max_over_mean")


async def _until_workers_serve(http: aiohttp.ClientSession, base: str, workers: int) -> None:
    """Fresh connections until every worker has answered one, so the load reaches them all."""
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    chat = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    while len(seen) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only workers {sorted(seen)} of {workers} answered")
        async with http.post(base + "/v1/chat/completions", json=chat,
                             headers={"connection": "close"}) as resp:
            await resp.read()
            if resp.status == 200 and "x-kvrouter-worker" in resp.headers:
                seen.add(resp.headers["x-kvrouter-worker"])
        await asyncio.sleep(0.05)


async def _print_peer_share(http: aiohttp.ClientSession, bases: list[str]) -> None:
    """Each router's peer-share counters (fresh connections reach every worker), to stderr."""
    seen: set[str] = set()
    for base in bases:
        for _ in range(12):
            async with http.get(base + "/metrics", headers={"connection": "close"}) as resp:
                text = await resp.text()
            lines = " ".join(sorted(line.split("{", 1)[1] for line in text.splitlines()
                                    if line.startswith("kvrouter_peer_share_total{")))
            if lines not in seen:
                seen.add(lines)
                print(f"[workers-cache] {base} peer share: {lines}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace, group: ProcessGroup, tmp: Path, redis_url: str) -> None:
        self.args, self.group, self.tmp, self.redis_url = args, group, tmp, redis_url
        self.urls: list[str] = []
        self.runs = 0

    async def start_replicas(self, http: aiohttp.ClientSession) -> None:
        a = self.args
        procs: list[RunningProcess] = []
        for i in range(a.replicas):
            port = free_port()
            self.urls.append(f"http://127.0.0.1:{port}")
            procs.append(self.group.start(f"replica{i}", [
                sys.executable, "-m", "kvrouter.cli", "sim-replica", "--host", "127.0.0.1",
                "--port", str(port), "--profile", a.profile, "--time-scale", f"{a.time_scale:g}",
                "--seed", str(a.seed + i)]))
        await asyncio.gather(*(wait_ready(http, p, u, "/health", 60, lambda s: s == 200)
                               for p, u in zip(procs, self.urls)))

    def _config(self, port: int, share: bool, label: str, in_flight: bool = True) -> Path:
        self.runs += 1
        path = self.tmp / f"router-{self.runs}-{port}.yaml"
        extra: dict[str, Any] = {}
        if self.args.decision_log is not None:  # one file per run (and per worker)
            log = self.args.decision_log.resolve() / f"{self.runs:02d}-{label}.jsonl"
            extra["observability"] = {"decision_log": str(log)}
        path.write_text(yaml.safe_dump({**extra,
            "server": {"host": "127.0.0.1", "port": port, "replica_header": True},
            "replicas": self.urls,
            "policy": {"name": "coding-agent", "params": {}},
            # A key prefix per run: no session home or shared record outlives its run.
            "affinity": {"store": "redis", "redis_url": self.redis_url,
                         "key_prefix": f"bench{self.runs}:", "share_routing_state": share,
                         "share_in_flight": in_flight},
        }))
        return path

    async def start_routers(self, http: aiohttp.ClientSession, setup: str,
                            label: str) -> tuple[list[RunningProcess], list[str]]:
        serve = [sys.executable, "-m", "kvrouter.cli", "serve", "--config"]
        procs: list[RunningProcess] = []
        bases: list[str] = []
        if setup == "two-routers":
            conf = None
            for i in range(2):
                port = free_port()
                conf = conf or self._config(port, share=True, label=label)  # one key prefix for both
                procs.append(self.group.start(f"router{i}", serve + [str(conf), "--port", str(port)]))
                bases.append(f"http://127.0.0.1:{port}")
        else:
            port = free_port()
            conf = self._config(port, share=setup != "workers-2-unshared", label=label,
                                in_flight=setup != "workers-2-own-in-flight")
            workers = 1 if setup == "one-process" else 2
            procs.append(self.group.start(setup, serve + [str(conf), "--workers", str(workers)]))
            bases.append(f"http://127.0.0.1:{port}")
        for p, base in zip(procs, bases):
            await wait_ready(http, p, base, "/ready", 60, lambda s: s == 200)
        if setup.startswith("workers-2"):
            await _until_workers_serve(http, bases[0], 2)
        return procs, bases

    async def one(self, http: aiohttp.ClientSession, setup: str, keyed: bool) -> dict[str, Any]:
        a = self.args
        procs, bases = await self.start_routers(http, setup, f"{setup}-{'keyed' if keyed else 'keyless'}")
        try:
            await asyncio.gather(*(_flush(http, u) for u in self.urls))
            label = f"{setup} {'session keys' if keyed else 'no session keys'}"
            print(f"[workers-cache] {label}: running", file=sys.stderr, flush=True)
            report = await run_load(
                bases if len(bases) > 1 else bases[0], load_workload(a.workload), a.users, a.duration,
                seed=a.seed, time_scale=a.time_scale, replica_metrics_urls=self.urls, contender=setup,
                ramp_s=a.ramp, warm_start=True, warmup_s=a.warmup, session_header=keyed,
                progress=lambda line: None,
            )
            if a.decision_log is not None:
                await _print_peer_share(http, bases)
        finally:
            self.group.stop(procs)
        result = report["results"][setup]
        kept = {k: result.get(k) for k in KEPT}
        print(f"[workers-cache] {label}: cache hit rate {kept['cache_hit_rate']:.3f}, "
              f"ok {kept['requests_ok']}, failed {kept['requests_failed']}", file=sys.stderr, flush=True)
        return kept


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from tests.redis_server import RedisProcess

    tmp = Path(tempfile.mkdtemp(prefix="workers-cache-"))
    redis = RedisProcess(tmp)
    redis.start()
    group = ProcessGroup(tmp)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {"session_keys": {}, "no_session_keys": {}}
    try:
        async with aiohttp.ClientSession() as http:
            bench = Bench(args, group, tmp, redis.url)
            await bench.start_replicas(http)
            for _ in range(args.rounds):
                for keyed in {"both": (True, False), "yes": (True,), "no": (False,)}[args.keyed]:
                    for setup in args.setups.split(","):
                        key = "session_keys" if keyed else "no_session_keys"
                        results[key].setdefault(setup, []).append(await bench.one(http, setup, keyed))
    finally:
        group.close()
        redis.kill()
    return results


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 4) if known else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--profile", default="kimi-k2.6-b200-tp4")
    p.add_argument("--workload", default="coding-agent")
    p.add_argument("--users", type=int, default=24)
    p.add_argument("--duration", type=float, default=40.0, help="wall seconds per run")
    p.add_argument("--time-scale", type=float, default=5.0)
    p.add_argument("--ramp", type=float, default=60.0, help="model seconds")
    p.add_argument("--warmup", type=float, default=60.0, help="model seconds left out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--rounds", type=int, default=1, help="runs of every setup")
    p.add_argument("--keyed", choices=("both", "yes", "no"), default="both",
                   help="runs with session keys, without, or both")
    p.add_argument("--decision-log", type=Path,
                   help="directory: every router writes its decision log there, a file per run")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    t0 = time.monotonic()
    results = asyncio.run(main_async(args))
    out = {
        "command": portable_command(["python", *sys.argv]),
        "load_average_at_end": [round(v, 2) for v in os.getloadavg()],  # a shared, busy machine
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "decision_log")},
        "wall_s": round(time.monotonic() - t0, 1),
        # per setup: the mean over rounds, then each round's
        "cache_hit_rate": {keyed: {s: [_mean([r["cache_hit_rate"] for r in rounds])]
                                   + [r["cache_hit_rate"] for r in rounds] for s, rounds in runs.items()}
                           for keyed, runs in results.items()},
        "runs": results,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
