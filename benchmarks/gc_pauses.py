"""Garbage-collection pauses of the router, the load driver and the replicas under a live replay.

    python benchmarks/gc_pauses.py [--json gc-pauses.json]

Starts ``--replicas`` sim replicas (capacity and chars per token as one live-sweep point), then
replays the same Claude Code sessions (``benchmarks/live_sweep.py``'s trace, 144 requests, prompts
rendered up front) through a ``kvrouter serve`` process twice, side by side: once without the
start-up freeze (``no-freeze``: the router's start-up heap left in the collector's generations)
and once as the router runs (``current``: ``router/serve.py``'s ``freeze_startup_heap``). The
router and the replicas run as this script in ``router-child`` / ``replica-child`` mode: a
``gc.callbacks`` hook times every collection (the router's from the moment it is ready), and the
router counts the objects the collector still tracks when it is told to stop. The driver (this
process) is timed the same way during each replay. Printed per process and mode: collections
and pauses of 5 ms or more per generation, p99 and max pause (wall), total paused time, the
collections' CPU time, tracked objects and the replay's TTFT p95.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import live_sweep  # noqa: E402
from portable import portable_command  # noqa: E402

from kvrouter.loadtest.compare import _flush, _router_config_file  # noqa: E402
from kvrouter.loadtest.process_group import ProcessGroup, free_port, wait_ready  # noqa: E402
from kvrouter.loadtest.report import percentile  # noqa: E402

MODES = ("no-freeze", "current")
LONG_PAUSE_S = 0.005


def _leave_the_collector_alone() -> None:
    """The router without `freeze_startup_heap`: its start-up heap stays in the generations."""


def pause_hook(pauses: list[tuple[int, float, float]]) -> Any:
    """A ``gc.callbacks`` hook appending (generation, wall seconds, CPU seconds) per collection.
    Wall is what the event loop waits; on a loaded machine it includes time the process was not
    scheduled, which the CPU time leaves out."""
    started = [0.0, 0.0]

    def hook(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[:] = time.perf_counter(), time.thread_time()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0], time.thread_time() - started[1]))

    return hook


def driver_stats(pauses: list[tuple[int, float, float]]) -> dict[str, Any]:
    census = Counter(type(o).__name__ for o in gc.get_objects())
    return {"pauses": pauses, "tracked": sum(census.values()), "frozen": gc.get_freeze_count(),
            "census": census.most_common(12)}


def replica_child(stats_path: str, argv: list[str]) -> int:
    """Run ``kvrouter`` (a sim replica) with ``argv``, appending every collection to ``stats_path``
    as it ends (a JSON line with its wall time), so the pauses survive however the process ends."""
    from kvrouter.cli import main

    out = open(stats_path, "ab", buffering=0)
    started = [0.0, 0.0]

    def hook(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[:] = time.perf_counter(), time.thread_time()
        else:
            wall, cpu = time.perf_counter() - started[0], time.thread_time() - started[1]
            out.write(orjson.dumps([info["generation"], wall, cpu, time.time()]) + b"\n")

    gc.callbacks.append(hook)
    return main(argv)


def replica_pauses(paths: list[Path], start: float, end: float) -> dict[str, Any]:
    """The replicas' collections between wall times ``start`` and ``end``, all replicas pooled."""
    pauses = []
    for path in paths:
        if path.exists():
            for line in path.read_bytes().splitlines():
                gen, wall, cpu, at = orjson.loads(line)
                if start <= at <= end:
                    pauses.append((gen, wall, cpu))
    return summarize({"pauses": pauses, "tracked": 0, "frozen": 0, "census": []})


def router_child(mode: str, stats_path: str, argv: list[str]) -> int:
    """Run ``kvrouter`` with ``argv`` in this process, timing every collection once it is ready."""
    from kvrouter.cli import main
    from kvrouter.router import serve as serve_module

    pauses: list[tuple[int, float, float]] = []
    hook = pause_hook(pauses)

    tuned = serve_module.freeze_startup_heap

    def ready_heap() -> None:
        (tuned if mode == "current" else _leave_the_collector_alone)()
        gc.callbacks.append(hook)

    serve_module.freeze_startup_heap = ready_heap
    census: Counter[str] = Counter()
    stop = serve_module.graceful_stop

    async def take_census_then_stop(*args: Any) -> None:
        census.update(type(o).__name__ for o in gc.get_objects())  # the heap the replay left
        await stop(*args)

    serve_module.graceful_stop = take_census_then_stop

    def write_stats() -> None:
        gc.callbacks.clear()
        Path(stats_path).write_bytes(orjson.dumps({
            "pauses": pauses, "tracked": sum(census.values()), "frozen": gc.get_freeze_count(),
            "census": census.most_common(12), "threshold": gc.get_threshold(),
        }))

    atexit.register(write_stats)
    return main(argv)


def summarize(stats: dict[str, Any]) -> dict[str, Any]:
    pauses = stats["pauses"]
    durations = [d for _, d, _ in pauses]
    cpu = [c for _, _, c in pauses]
    by_gen = {}
    for gen in (0, 1, 2):
        mine = [d for g, d, _ in pauses if g == gen]
        by_gen[f"gen{gen}"] = {"collections": len(mine),
                               "long": sum(1 for d in mine if d >= LONG_PAUSE_S),
                               "max_ms": round(max(mine) * 1e3, 2) if mine else 0.0,
                               "total_ms": round(sum(mine) * 1e3, 1)}
    return {
        "collections": len(pauses),
        "long_pauses": sum(1 for d in durations if d >= LONG_PAUSE_S),
        "p99_ms": round((percentile(durations, 99) or 0.0) * 1e3, 2),
        "max_ms": round(max(durations, default=0.0) * 1e3, 2),
        "total_ms": round(sum(durations) * 1e3, 1),
        "max_cpu_ms": round(max(cpu, default=0.0) * 1e3, 2),
        "total_cpu_ms": round(sum(cpu) * 1e3, 1),
        "by_generation": by_gen,
        "tracked_objects_at_end": stats["tracked"],
        "frozen_objects_at_end": stats["frozen"],
        "census": stats["census"],
    }


async def replay(args: argparse.Namespace, arrivals: Any, capacity: int, tmp: Path) -> dict[str, Any]:
    group = ProcessGroup(tmp)
    point = live_sweep.Point("sim", args.capacity, args.chars_per_token)
    out: dict[str, Any] = {}
    procs: list[Any] = []
    try:
        async with aiohttp.ClientSession() as http:
            urls, replica_stats = [], []
            for i in range(args.replicas):
                port = free_port()
                argv = live_sweep.replica_argv(point, port, capacity, args, tmp, i)
                replica_stats.append(tmp / f"gc-replica{i}.jsonl")
                argv[1:3] = [str(Path(__file__).resolve()), "replica-child", str(replica_stats[-1])]
                urls.append(f"http://127.0.0.1:{port}")
                procs.append(group.start(f"replica{i}", argv))
            await asyncio.gather(*(wait_ready(http, p, u, "/health", 60.0, lambda s: s == 200)
                                   for p, u in zip(procs, urls)))
            for mode in MODES:
                await asyncio.gather(*(_flush(http, u) for u in urls))
                port = free_port()
                conf = tmp / f"router-{mode}.yaml"
                observability = {"decision_log": str(tmp / f"decisions-{mode}.jsonl")} if args.decision_log else None
                _router_config_file(conf, args.policy, port, urls, observability)
                stats_path = tmp / f"gc-{mode}.json"
                argv = [sys.executable, str(Path(__file__).resolve()), "router-child", mode, str(stats_path),
                        "serve", "--config", str(conf), "--policy", args.policy]
                proc = group.start(f"router-{mode}", argv)
                base = f"http://127.0.0.1:{port}"
                await wait_ready(http, proc, base, "/ready", 60.0, lambda s: s == 200)
                driver_pauses: list[tuple[int, float, float]] = []
                hook = pause_hook(driver_pauses)
                gc.callbacks.append(hook)
                replay_start = time.time()
                try:
                    report = await live_sweep.replay_arrivals(base, arrivals, urls, args, mode)
                finally:
                    replay_end = time.time()
                    gc.callbacks.remove(hook)
                    group.stop([proc], grace_s=20.0)
                result = report["results"][mode]
                out[mode] = {**summarize(orjson.loads(stats_path.read_bytes())),
                             "requests_ok": result["requests_ok"], "requests_failed": result["requests_failed"],
                             "ttft_p95_s": None if result["ttft_p95_s"] is None else round(result["ttft_p95_s"], 3),
                             "driver": summarize(driver_stats(driver_pauses)),
                             "replicas": replica_pauses(replica_stats, replay_start, replay_end)}
                print(f"{mode}: {out[mode]['collections']} collections, {out[mode]['long_pauses']} >= 5 ms, "
                      f"max {out[mode]['max_ms']} ms", file=sys.stderr, flush=True)
    finally:
        group.close()
    return out


def print_table(out: dict[str, Any]) -> None:
    rows = [("collections", lambda r: r["collections"]), ("pauses >= 5 ms", lambda r: r["long_pauses"])]
    for gen in (0, 1, 2):
        rows.append((f"gen{gen} collections (>= 5 ms)",
                     lambda r, g=gen: f"{r['by_generation'][f'gen{g}']['collections']} "
                                      f"({r['by_generation'][f'gen{g}']['long']})"))
        rows.append((f"gen{gen} max ms", lambda r, g=gen: r["by_generation"][f"gen{g}"]["max_ms"]))
    rows += [("p99 pause ms", lambda r: r["p99_ms"]), ("max pause ms", lambda r: r["max_ms"]),
             ("total paused ms", lambda r: r["total_ms"]),
             ("max / total CPU ms", lambda r: f"{r['max_cpu_ms']} / {r['total_cpu_ms']}"),
             ("tracked objects at end", lambda r: r["tracked_objects_at_end"]),
             ("frozen objects at end", lambda r: r["frozen_objects_at_end"]),
             ("requests ok / failed", lambda r: f"{r['requests_ok']} / {r['requests_failed']}"),
             ("TTFT p95 s (model)", lambda r: r["ttft_p95_s"])]
    driver_rows = rows[:13]
    print(f"{'router':30}" + "".join(f"{m:>18}" for m in out))
    for name, get in rows:
        print(f"{name:30}" + "".join(f"{str(get(r)):>18}" for r in out.values()))
    print(f"{'driver':30}" + "".join(f"{m:>18}" for m in out))
    for name, get in driver_rows:
        print(f"{name:30}" + "".join(f"{str(get(r['driver'])):>18}" for r in out.values()))
    print(f"{'replicas (pooled)':30}" + "".join(f"{m:>18}" for m in out))
    for name, get in rows[:12]:
        print(f"{name:30}" + "".join(f"{str(get(r['replicas'])):>18}" for r in out.values()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["replica-child"]:
        return replica_child(argv[1], argv[2:])
    if argv[:1] == ["router-child"]:
        return router_child(argv[1], argv[2], argv[3:])
    p = argparse.ArgumentParser(description="Router GC pauses under a live trace replay, before and after")
    live_sweep.add_single_point_args(p)
    p.add_argument("--decision-log", action="store_true", help="routers write a decision log (as --records-dir)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    arrivals, capacity = live_sweep.single_point_replay(args)
    with tempfile.TemporaryDirectory(prefix="kvrouter-gc-pauses-") as tmp:
        out = asyncio.run(replay(args, arrivals, capacity, Path(tmp)))
    print_table(out)
    if args.json:
        data = {"schema": 1, "command": portable_command(["python", "benchmarks/gc_pauses.py", *argv]),
                "load_average": [round(x, 2) for x in os.getloadavg()], "long_pause_ms": LONG_PAUSE_S * 1e3,
                "results": out}
        Path(args.json).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
