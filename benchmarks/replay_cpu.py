"""The router's CPU time over a live replay of the Claude Code sessions, before and after.

    python benchmarks/replay_cpu.py [--cprofile] [--json replay-cpu.json]

Starts ``--replicas`` sim replicas (capacity and chars per token as one live-sweep point), then
replays the same 144 requests as ``benchmarks/gc_pauses.py`` (``benchmarks/live_sweep.py``'s
trace, prompts rendered up front) through a ``kvrouter serve`` process per mode, side by side:
``before`` (the router with its replica poller parsing every ``/metrics`` page whole-page
filtered, as it did) and ``current`` (as the router runs). Each router is this script in
``router-child`` mode. Per mode: the router's CPU seconds (user + system, from
``/proc/PID/stat``) while idle for ``--idle-s`` after it is ready (its background work alone:
replica polls, housekeeping) and over the replay, the replay's wall time, so the background
share of the replay, and, counted in the router, its poll rounds, ``/metrics`` pages and bytes
and the CPU spent turning a page into signals. ``--cprofile`` runs the routers under cProfile
(slower: the totals are then not comparable with a run without it) and prints where the time
went.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
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

MODES = ("before", "current")
TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _install_before() -> None:
    """The poller's parsing as it was (over its current HTTP client): every page decoded and
    its gauge lines parsed by ``prometheus_client``, poll after poll, even when the page is the
    same bytes."""
    from kvrouter.router import poller
    from kvrouter.sglang_protocol import signals

    async def scrape(self: Any, url: str) -> Any:
        status, body = await self._get(url, "/metrics")
        if status == 200:
            return poller.parse_metrics_text(body.decode("utf-8", "replace"))
        raise poller.SignalParseError(f"/metrics answered {status}")

    poller.SignalPoller._scrape = scrape
    signals.plain_samples = lambda text: None


def _count_polls(counts: dict[str, float]) -> None:
    """Count poll rounds, pages parsed, their bytes and the CPU of parsing them."""
    from kvrouter.router import poller

    start_round = poller.SignalPoller._start_round
    parse = poller.parse_metrics_text

    async def counted_start_round(self: Any, *args: Any, **kwargs: Any) -> None:
        counts["rounds"] += 1
        await start_round(self, *args, **kwargs)

    def counted_parse(text: str) -> Any:
        started = time.thread_time()
        try:
            return parse(text)
        finally:
            counts["parse_cpu_s"] += time.thread_time() - started
            counts["pages"] += 1
            counts["page_bytes"] += len(text)

    poller.SignalPoller._start_round = counted_start_round
    poller.parse_metrics_text = counted_parse


def router_child(mode: str, stats_path: str, profile: bool, argv: list[str]) -> int:
    """Run ``kvrouter`` with ``argv`` in this process, counting its polls, profiled if asked."""
    from kvrouter.cli import main

    if mode == "before":
        _install_before()
    counts = {"rounds": 0, "pages": 0, "page_bytes": 0, "parse_cpu_s": 0.0}
    _count_polls(counts)
    profiler = cProfile.Profile() if profile else None

    def write_stats() -> None:
        out: dict[str, Any] = {"counts": counts}
        if profiler is not None:
            profiler.disable()
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(40)
            out["profile"] = text.getvalue()
        Path(stats_path).write_bytes(orjson.dumps(out))

    atexit.register(write_stats)
    if profiler is not None:
        profiler.enable()
    return main(argv)


async def replay(args: argparse.Namespace, arrivals: Any, capacity: int, tmp: Path) -> dict[str, Any]:
    group = ProcessGroup(tmp)
    point = live_sweep.Point("sim", args.capacity, args.chars_per_token)
    out: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession() as http:
            procs, urls = await live_sweep.start_replicas(point, capacity, args, group, http, tmp)
            for mode in args.modes.split(","):
                await asyncio.gather(*(_flush(http, u) for u in urls))
                port = free_port()
                conf = tmp / f"router-{mode}.yaml"
                _router_config_file(conf, args.policy, port, urls)
                stats_path = tmp / f"cpu-{mode}.json"
                argv = [sys.executable, str(Path(__file__).resolve()), "router-child", mode, str(stats_path),
                        "1" if args.cprofile else "0", "serve", "--config", str(conf), "--policy", args.policy]
                proc = group.start(f"router-{mode}", argv)
                pid = proc.popen.pid
                base = f"http://127.0.0.1:{port}"
                await wait_ready(http, proc, base, "/ready", 60.0, lambda s: s == 200)
                idle_cpu = process_cpu_s(pid)
                idle_at = time.perf_counter()
                await asyncio.sleep(args.idle_s)
                idle_wall = time.perf_counter() - idle_at
                start_cpu = process_cpu_s(pid)
                idle_cpu = start_cpu - idle_cpu
                started = time.perf_counter()
                try:
                    report = await live_sweep.replay_arrivals(base, arrivals, urls, args, mode)
                finally:
                    replay_wall = time.perf_counter() - started
                    replay_cpu = process_cpu_s(pid) - start_cpu
                    group.stop([proc], grace_s=20.0)
                result = report["results"][mode]
                child = orjson.loads(stats_path.read_bytes())
                counts = child["counts"]
                background = idle_cpu / idle_wall * replay_wall
                out[mode] = {
                    "idle_cpu_ms_per_s": round(idle_cpu / idle_wall * 1e3, 2),
                    "replay_wall_s": round(replay_wall, 1),
                    "replay_cpu_s": round(replay_cpu, 2),
                    "background_cpu_s_at_idle_rate": round(background, 2),
                    "request_cpu_ms_per_request": round((replay_cpu - background) / max(1, result["requests_ok"]) * 1e3, 2),
                    "poll_rounds": counts["rounds"], "pages_parsed": counts["pages"],
                    "page_kb_mean": round(counts["page_bytes"] / max(1, counts["pages"]) / 1e3, 1),
                    "page_cpu_us_mean": round(counts["parse_cpu_s"] / max(1, counts["pages"]) * 1e6, 1),
                    "page_cpu_s_total": round(counts["parse_cpu_s"], 3),
                    "requests_ok": result["requests_ok"], "requests_failed": result["requests_failed"],
                    "ttft_p95_s": None if result["ttft_p95_s"] is None else round(result["ttft_p95_s"], 3),
                }
                if "profile" in child:
                    out[mode]["profile"] = child["profile"]
                print(f"{mode}: {out[mode]['replay_cpu_s']} CPU s over {out[mode]['replay_wall_s']} s",
                      file=sys.stderr, flush=True)
    finally:
        group.close()
    return out


def print_table(out: dict[str, Any]) -> None:
    keys = [k for k in next(iter(out.values())) if k != "profile"]
    print(f"{'router':34}" + "".join(f"{m:>14}" for m in out))
    for key in keys:
        print(f"{key:34}" + "".join(f"{str(r[key]):>14}" for r in out.values()))
    if set(MODES) <= set(out) and out["before"]["replay_cpu_s"]:
        print(f"replay CPU current / before: {out['current']['replay_cpu_s'] / out['before']['replay_cpu_s']:.2f}")
    for mode, r in out.items():
        if "profile" in r:
            print(f"\n===== profile: {mode} =====\n{r['profile']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["router-child"]:
        return router_child(argv[1], argv[2], argv[3] == "1", argv[4:])
    p = argparse.ArgumentParser(description="Router CPU over a live trace replay, before and after")
    live_sweep.add_single_point_args(p)
    p.add_argument("--idle-s", type=float, default=5.0, help="router idle time measured before each replay")
    p.add_argument("--modes", default=",".join(MODES), help="which of before,current to run, in order")
    p.add_argument("--cprofile", action="store_true", help="run the routers under cProfile and print it")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    arrivals, capacity = live_sweep.single_point_replay(args)
    with tempfile.TemporaryDirectory(prefix="kvrouter-replay-cpu-") as tmp:
        out = asyncio.run(replay(args, arrivals, capacity, Path(tmp)))
    print_table(out)
    if args.json:
        data = {"schema": 1, "command": portable_command(["python", "benchmarks/replay_cpu.py", *argv]),
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "results": {m: {k: v for k, v in r.items() if k != "profile"} for m, r in out.items()}}
        Path(args.json).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
