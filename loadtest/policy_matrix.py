"""Does the default policy hold its ranking outside its own model? Every policy in every setting
over several seeds, in the cluster simulator:

    python -m kvrouter.loadtest.policy_matrix --seeds 1,2,3 --json docs/simulation/policy-matrix.json

Settings: the coding-agent workload in the nominal world and in each `--world-perturb` world
(speed=2, speed=0.5, capacity=0.7, signal-lag=2; world.py) on a 20-replica fleet, the busy
workload (16 x 80, as in docs/routing.md), and the Claude Code replay (15 sessions x 2 users on 4
replicas, as in docs/simulation.md); `--cost-scale F` multiplies the default policy's prefill
constants (its roofline) by F, to show what a 2x error either way does to the ranking. The table
gives, per setting and policy, the mean over the seeds of the cache-hit rate and TTFT p95 with
their range, and whether the default's mean is at least as good as every baseline's on each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .cluster_sim import ClusterSimulator, SimConfig
from .scenarios import SHARED_TRACES
from .world import parse_world
from .workload_config import load_workload

DEFAULT = "coding-agent"
POLICIES = (DEFAULT, "prefix-aware", "consistent-hash")
WORLDS = ("nominal", "speed=2", "speed=0.5", "capacity=0.7", "signal-lag=2")
SETTINGS = (*WORLDS, "busy", "claude-code")


def _run(setting: str, policy: str, seed: int, params: dict[str, Any], traces: Path) -> dict[str, Any]:
    arrivals = None
    if setting == "busy":
        cfg = SimConfig(replicas=16, sessions=80, duration_s=900, seed=seed)
        workload = load_workload("coding-agent-busy")
    elif setting == "claude-code":
        from .trace_claude_code import claude_code_arrivals

        cfg = SimConfig(replicas=4, duration_s=1800.0, seed=seed, warmup_s=0, warm_start=False)
        arrivals = claude_code_arrivals(traces, copies=2, max_context_tokens=262_144)
        workload = load_workload("coding-agent")
    else:
        cfg = SimConfig(replicas=20, sessions=100, duration_s=600, seed=seed, world=parse_world(setting))
        workload = load_workload("coding-agent")
    if policy == DEFAULT and params:
        cfg = dataclasses.replace(cfg, policy_params=params)
    r = ClusterSimulator(cfg, policy, workload, arrivals=arrivals).run()
    return {k: r[k] for k in ("cache_hit_rate", "ttft_p50_s", "ttft_p95_s", "requests_ok",
                              "requests_failed", "decisions_measured")}


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def summarize(runs: dict[str, dict[str, dict[int, dict[str, Any]]]]) -> dict[str, Any]:
    """runs[setting][policy][seed] -> per setting and policy: cache-hit rate and TTFT p95 stats,
    and whether the default's mean is at least every baseline's (higher CHR, lower p95)."""
    out: dict[str, Any] = {}
    for setting, by_policy in runs.items():
        row: dict[str, Any] = {}
        for policy, by_seed in by_policy.items():
            row[policy] = {
                "cache_hit_rate": _stats([r["cache_hit_rate"] for r in by_seed.values()]),
                "ttft_p95_s": _stats([r["ttft_p95_s"] for r in by_seed.values()]),
            }
        if DEFAULT in row:
            others = [p for p in row if p != DEFAULT]
            mine = row[DEFAULT]
            row["default_best_chr"] = all(
                mine["cache_hit_rate"]["mean"] >= row[p]["cache_hit_rate"]["mean"] for p in others)
            row["default_best_p95"] = all(
                mine["ttft_p95_s"]["mean"] <= row[p]["ttft_p95_s"]["mean"] for p in others)
        out[setting] = row
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| setting | policy | CHR mean (range) | TTFT p95 s mean (range) |", "|---|---|---|---|"]
    for setting, row in summary.items():
        for policy, m in row.items():
            if not isinstance(m, dict):
                continue
            c, t = m["cache_hit_rate"], m["ttft_p95_s"]
            mark_c = mark_t = ""
            if policy == DEFAULT:
                mark_c = "" if row["default_best_chr"] else " (behind)"
                mark_t = "" if row["default_best_p95"] else " (behind)"
            lines.append(f"| {setting} | {policy} | {c['mean']:.3f} ({c['min']:.3f}-{c['max']:.3f}){mark_c} "
                         f"| {t['mean']:.2f} ({t['min']:.2f}-{t['max']:.2f}){mark_t} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--cost-scale", type=float, default=1.0,
                        help="multiply the default policy's prefill constants by this (2x off: 0.5 or 2)")
    parser.add_argument("--traces", type=Path, default=SHARED_TRACES)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    params: dict[str, Any] = {}
    if args.cost_scale != 1.0:
        from ..policies.cost import CostParams

        base = CostParams()
        params = {"cost": {"prefill_s_per_token": base.prefill_s_per_token * args.cost_scale,
                           "attn_s_per_token_pair": base.attn_s_per_token_pair * args.cost_scale}}
    runs: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    for setting in args.settings.split(","):
        for policy in args.policies.split(","):
            for seed in seeds:
                started = time.perf_counter()
                result = _run(setting, policy, seed, params, args.traces)
                runs.setdefault(setting, {}).setdefault(policy, {})[seed] = result
                print(f"{setting} {policy} seed {seed}: CHR {result['cache_hit_rate']:.3f} TTFT p95 "
                      f"{result['ttft_p95_s']:.2f} s ({time.perf_counter() - started:.0f} s)",
                      file=sys.stderr, flush=True)
    summary = summarize(runs)
    print(markdown(summary))
    if args.json:
        command = "python -m kvrouter.loadtest.policy_matrix " + " ".join(sys.argv[1:])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, "seeds": seeds, "cost_scale": args.cost_scale,
                                         "summary": summary, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
