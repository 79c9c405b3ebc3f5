"""`kvrouter simulate`: run the cluster simulator for one or more policies on the same seeded traffic.

    kvrouter simulate --replicas 50 --sessions 250 --policy coding-agent,consistent-hash \
        --duration 600 --seed 1 --scale 300:+10 --json out.json

Scale events: `T:+K` adds K fresh replicas at T seconds; `T:-K` kills the K lowest-numbered
replicas; `T:-replica-0003,replica-0007` kills those. Output: a table on stdout (and events/s, a
wall-clock figure kept out of the JSON so the same seed gives byte-identical JSON).

Perturbed worlds: `--world-perturb SPEC` (repeatable) runs every policy again in a fleet whose true
behaviour differs from the profile the policy's constants assume (loadtest/world.py): e.g.
`--world-perturb nominal --world-perturb speed=2 --world-perturb capacity=0.7,signal-lag=2`.
Results are then keyed `<policy> @ <world>`, with the same seeded traffic in every world.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from .cluster_sim import ClusterSimulator, ScaleEvent, SimConfig, replica_name
from .cluster_sim_dp import DPClusterSimulator
from .cluster_sim_pd import PDClusterSimulator, split_fleet
from .report import build_report
from .workload_config import load_workload
from .world import World, WorldSpecError, parse_world

TABLE_COLUMNS = (
    ("requests_ok", "ok", "{:.0f}"),
    ("requests_failed", "failed", "{:.0f}"),
    ("cache_hit_rate", "CHR", "{:.3f}"),
    ("ttft_p50_s", "TTFT p50", "{:.3f}"),
    ("ttft_p95_s", "TTFT p95", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99", "{:.3f}"),
    ("output_tps_per_user", "tok/s/user", "{:.1f}"),
    ("tokens_per_min_per_replica", "tok/min/replica", "{:.0f}"),
    ("e2e_p95_s", "e2e p95", "{:.2f}"),
    ("load_max_over_mean", "load max/mean", "{:.2f}"),
    ("load_cv", "load CV", "{:.2f}"),
)


def parse_scale(spec: str, replicas: int) -> ScaleEvent:
    """`T:+K`, `T:-K` or `T:-name,name`."""
    try:
        at, what = spec.split(":", 1)
        at_s = float(at)
        if what.startswith("+"):
            return ScaleEvent(at_s, add=int(what[1:]))
        if what.startswith("-"):
            body = what[1:]
            if body.isdigit():
                return ScaleEvent(at_s, remove=tuple(replica_name(i) for i in range(int(body))))
            return ScaleEvent(at_s, remove=tuple(n for n in body.split(",") if n))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"bad --scale {spec!r}: want T:+K, T:-K or T:-name,name")


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    head = "| policy | " + " | ".join(title for _, title, _ in TABLE_COLUMNS) + " |"
    rule = "|---" * (len(TABLE_COLUMNS) + 1) + "|"
    rows = [head, rule]
    for name, res in results.items():
        cells = []
        for key, _, fmt in TABLE_COLUMNS:
            value = res.get(key)
            cells.append("-" if value is None else fmt.format(value))
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def sessions_max_over_mean(result: dict[str, Any]) -> float | None:
    """Sessions per replica, max/mean, averaged over the run's samples."""
    ratios = [s["max"] / s["mean"] for s in result.get("session_timeline", ()) if s["mean"] > 0]
    return sum(ratios) / len(ratios) if ratios else None


def world_key(policy: str, world: World) -> str:
    return f"{policy} @ {world.spec}"


def world_table(results: dict[str, dict[str, Any]], worlds: list[World], policies: list[str]) -> str:
    """Side by side: one row per (world, policy), as keyed by `world_key`."""
    rows = ["| world | policy | CHR | TTFT p50 (s) | TTFT p95 (s) | sessions/replica max/mean | ok |",
            "|---|---|---|---|---|---|---|"]
    for world in worlds:
        for policy in policies:
            r = results[world_key(policy, world)]
            cells = [r.get("cache_hit_rate"), r.get("ttft_p50_s"), r.get("ttft_p95_s"),
                     sessions_max_over_mean(r)]
            text = ["-" if c is None else f"{c:.3f}" for c in cells]
            rows.append(f"| {world.spec} | {policy} | " + " | ".join(text) + f" | {r['requests_ok']} |")
    return "\n".join(rows)


def _round(value: Any) -> Any:
    """Floats rounded to 6 significant digits: stable JSON, honest precision."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


def layout_problem(args: argparse.Namespace, layout: str, scale: tuple[ScaleEvent, ...]) -> str | None:
    """Why `--layout` cannot run with these arguments (None: it can)."""
    if getattr(args, "decode_servers", None) is not None and layout != "pd":
        return "--decode-servers needs --layout pd"
    if getattr(args, "dp_size", None) is not None and layout != "dp":
        return "--dp-size needs --layout dp"
    if layout == "colocated":
        return None
    if scale:
        return f"--scale is not modelled with --layout {layout}"
    if layout == "dp":
        return None if (args.dp_size or 0) >= 2 else "--layout dp needs --dp-size 2 or more"
    try:
        split_fleet(args.replicas, args.decode_servers)
    except ValueError as err:
        return f"--layout pd: {err}"
    return None


def make_simulator(layout: str, args: argparse.Namespace, config: SimConfig, policy: str,
                   workload: Any, arrivals: Any) -> ClusterSimulator:
    if layout == "pd":
        return PDClusterSimulator(config, policy, workload, decode_servers=args.decode_servers,
                                  arrivals=arrivals)
    if layout == "dp":
        return DPClusterSimulator(config, policy, workload, dp_size=args.dp_size, arrivals=arrivals)
    return ClusterSimulator(config, policy, workload, arrivals=arrivals)


def traffic_problem(args: argparse.Namespace) -> str | None:
    """Why the options shaping the synthetic traffic cannot be run as given, if they cannot."""
    if args.ramp is not None and args.ramp < 0:
        return "--ramp must be >= 0"
    if args.eos_median is not None and args.eos_median < 1:
        return "--eos-median must be >= 1 (tokens)"
    if args.warm_start_as_driver and (args.cold_start or args.trace):
        return "--warm-start-as-driver draws where synthetic sessions start warm: not with --cold-start or --trace"
    return None


def run(args: argparse.Namespace) -> int:
    try:
        worlds = [parse_world(spec) for spec in args.world_perturb or ()]
    except WorldSpecError as err:
        print(f"kvrouter simulate: --world-perturb: {err}", file=sys.stderr)
        return 2
    workload = load_workload(args.workload)
    scale = tuple(parse_scale(s, args.replicas) for s in args.scale or ())
    layout = getattr(args, "layout", "colocated")
    problem = layout_problem(args, layout, scale) or traffic_problem(args)
    if problem:
        print(f"kvrouter simulate: {problem}", file=sys.stderr)
        return 2
    config = SimConfig(
        replicas=args.replicas, profile=args.profile, duration_s=args.duration, seed=args.seed,
        sessions=args.sessions, poll_interval_s=args.poll_interval, warmup_s=args.warmup,
        warm_start=not args.cold_start, scale_events=scale, page_tokens=args.page_tokens,
        ramp_s=args.ramp, eos_median=args.eos_median, warm_start_as_driver=args.warm_start_as_driver,
    )
    arrivals_for = None
    if args.trace:
        from .traces import trace_sessions  # trace replay: sessions arrive as the trace says

        # Kimi K2.6 serves 256K of context; longer trace requests are dropped (their time kept).
        arrivals_for = lambda: trace_sessions(args.trace, max_context_tokens=262_144)  # noqa: E731
    policies = args.policy.split(",")
    results: dict[str, dict[str, Any]] = {}
    for world in worlds or [World()]:
        for policy in policies:
            started = time.perf_counter()
            sim = make_simulator(layout, args, dataclasses.replace(config, world=world), policy, workload,
                                 arrivals_for() if arrivals_for else None)
            name = world_key(policy, world) if worlds else policy
            results[name] = _round(sim.run())
            wall = time.perf_counter() - started
            print(f"{name}: {sim.events} events in {wall:.1f} s ({sim.events / wall:,.0f} events/s)",
                  file=sys.stderr)
    workload_info = {
        "name": workload.name, "source": str(args.trace or args.workload), "seed": args.seed,
        "replicas": args.replicas, "profile": args.profile, "duration_s": args.duration,
        "sessions": args.sessions if args.sessions is not None else 5 * args.replicas,
        "warmup_s": args.warmup, "warm_start": not args.cold_start, "page_tokens": args.page_tokens,
        "scale": [e.__dict__ | {"remove": list(e.remove)} for e in scale],
    }
    if args.ramp is not None:  # JSON without --ramp / --eos-median stays as it always was
        workload_info["ramp_s"] = args.ramp
    if args.eos_median is not None:
        workload_info["eos_median"] = args.eos_median
    if args.warm_start_as_driver:
        workload_info["warm_start_as_driver"] = True
    if layout == "pd":  # colocated JSON stays as it always was
        workload_info["layout"] = layout
        workload_info["decode_servers"] = split_fleet(args.replicas, args.decode_servers)[1]
    elif layout == "dp":
        workload_info["layout"] = layout
        workload_info["dp_size"] = args.dp_size
    if worlds:
        workload_info["worlds"] = [dataclasses.asdict(w) for w in worlds]
        print(world_table(results, worlds, policies))
    else:
        print(markdown_table(results))
    if args.json:
        report = build_report(workload_info, results)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
