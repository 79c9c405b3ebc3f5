"""The fleet-scale scenarios behind docs/simulation.md, each a function of the cluster simulator.

    python -m kvrouter.loadtest.scenarios [--quick] [--out docs/simulation.md]

1. textbook: 250 sessions arriving on 50 replicas; sessions per replica under consistent_hash vs
   coding-agent, averaged over seeds and over the run (Poisson(5): 4.0% of replicas with <= 1,
   0.55% with >= 12).
2. scale-out: 40 -> 50 replicas mid-run; cache-hit rate and TTFT in the two minutes after the event.
3. claude-code: the 15 public Claude Code sessions (two users each) replayed on a fleet too small
   for all their KV; each policy's cache-hit rate against the trace's own reuse bound.
4. resolution: the same run at 64- and 512-token pages (what the faster setting changes).
5. performance: 1000 replicas x 5000 sessions x 10 simulated minutes; wall time and events/s.

`--only claude-code[,resolution,performance]` re-runs just those sections and replaces them in
`--out` (and their numbers in `simulation/scenarios.json`), keeping the rest of the file.

Sections run by their own command and written by hand (`KEPT_SECTIONS`: the perturbed worlds of
`kvrouter simulate --world-perturb`, the several-seeds tables of `loadtest/policy_matrix.py`, the
note on what changed in the simulator) are carried over
from the existing `--out` file. With `--out`, the numbers behind every table are also written to
`simulation/scenarios.json` beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .cluster_sim import ClusterSimulator, ScaleEvent, SimConfig
from .report import summarize_requests
from .simulate import markdown_table
from .workload_config import load_workload

POLICIES = ("coding-agent", "consistent-hash", "prefix-aware", "round-robin")
KEPT_SECTIONS = ("Perturbed worlds", "Several seeds, and the policy's constants 2x off", "What changed in the simulator")
SHARED_TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "weka_claude_code"


def textbook(seeds: int, duration_s: float = 300.0) -> tuple[str, dict[str, Any]]:
    rows = {}
    for policy in ("consistent-hash", "coding-agent"):
        low, high, ratio, idle = [], [], [], []
        counts: list[int] = []
        for seed in range(seeds):
            # Sessions arrive fresh (turn 1) over the first minute, as in the textbook placement
            # question; ended sessions are replaced by new arrivals (closed loop).
            sim = ClusterSimulator(SimConfig(replicas=50, sessions=250, duration_s=duration_s,
                                             seed=seed, drain_s=0, warm_start=False),
                                   policy, load_workload("coding-agent"))
            result = sim.run()
            counts.extend(result["homed_sessions_per_replica"])
            for sample in result["session_timeline"]:
                low.append(sample["at_most_1_fraction"])
                high.append(sample["at_least_12_fraction"])
                ratio.append(sample["max"] / sample["mean"])
                idle.append(1 if sample["min"] == 0 else 0)
        rows[policy] = {
            "replicas_with_at_most_1_session": statistics.mean(low),
            "replicas_with_12_or_more": statistics.mean(high),
            "max_over_mean_sessions_mean": statistics.mean(ratio),
            "max_over_mean_sessions_worst": max(ratio),
            "samples_with_an_idle_replica": statistics.mean(idle),
            "sessions_per_replica_at_end": counts,
        }
    lines = ["| policy | replicas with <= 1 session | with >= 12 | sessions max/mean (mean) | (worst) | samples with an empty replica |",
             "|---|---|---|---|---|---|"]
    for policy, r in rows.items():
        lines.append(f"| {policy} | {r['replicas_with_at_most_1_session']:.2%} | {r['replicas_with_12_or_more']:.2%} | "
                     f"{r['max_over_mean_sessions_mean']:.2f} | {r['max_over_mean_sessions_worst']:.2f} | "
                     f"{r['samples_with_an_idle_replica']:.1%} |")
    lines.append("| Poisson(5) | 4.04% | 0.55% | | | |")
    return "\n".join(lines), rows


def scale_out(duration_s: float = 600.0, at_s: float = 300.0, window_s: float = 120.0) -> tuple[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for policy in ("coding-agent", "consistent-hash"):
        config = SimConfig(replicas=40, sessions=250, duration_s=duration_s, seed=7,
                           scale_events=(ScaleEvent(at_s, add=10),))
        sim = ClusterSimulator(config, policy, load_workload("coding-agent"))
        sim.run()
        step = 30.0
        timeline = []
        for w in range(int(duration_s // step)):
            recs = [r for r in sim.records if w * step <= r.start_s < (w + 1) * step]
            res = summarize_requests(recs, 1, step)
            timeline.append((w * step + step / 2, res["cache_hit_rate"], res["ttft_p95_s"]))
        before = [r for r in sim.records if at_s - window_s <= r.start_s < at_s]
        after = [r for r in sim.records if at_s <= r.start_s < at_s + window_s]
        b = summarize_requests(before, 40, window_s)
        a = summarize_requests(after, 50, window_s)
        new = [f"replica-{i:04d}" for i in range(40, 50)]
        results[policy] = {
            "chr_before": b["cache_hit_rate"], "chr_after": a["cache_hit_rate"],
            "ttft_p95_before_s": b["ttft_p95_s"], "ttft_p95_after_s": a["ttft_p95_s"],
            "sessions_on_new_replicas_at_end": sum(sim.table.homed_sessions.get(u, 0) for u in new),
            "sessions_moved_by_rebalance": sim.rebalanced,
            "timeline": timeline,
        }
    lines = ["| policy | CHR before | CHR after | TTFT p95 before (s) | TTFT p95 after (s) | sessions on the 10 new replicas at end | moved by rebalance |",
             "|---|---|---|---|---|---|---|"]
    for policy, r in results.items():
        lines.append(f"| {policy} | {r['chr_before']:.3f} | {r['chr_after']:.3f} | {r['ttft_p95_before_s']:.2f} | "
                     f"{r['ttft_p95_after_s']:.2f} | {r['sessions_on_new_replicas_at_end']} | {r['sessions_moved_by_rebalance']} |")
    return "\n".join(lines), results


def claude_code(traces: Path, replicas: int = 4, duration_s: float = 1800.0) -> tuple[str, dict[str, Any]]:
    from .trace_claude_code import claude_code_arrivals
    from .trace_stats import reuse_bound

    def arrivals():
        return claude_code_arrivals(traces, copies=2, max_context_tokens=262_144)

    bound = reuse_bound(arrivals(), 64)
    results: dict[str, dict[str, Any]] = {}
    for policy in POLICIES:
        sim = ClusterSimulator(SimConfig(replicas=replicas, duration_s=duration_s, seed=0, warmup_s=0,
                                         warm_start=False), policy, load_workload("coding-agent"),
                               arrivals=arrivals())
        results[policy] = sim.run()
    table = markdown_table(results)
    return f"Reuse bound of the replayed requests (infinite cache): **{bound:.3f}**\n\n{table}", {
        "reuse_bound": bound, "results": results}


def resolution(duration_s: float = 600.0) -> tuple[str, dict[str, Any]]:
    """The same 50 x 250 run at the profile's 64-token pages and at 512-token pages."""
    rows: dict[str, dict[str, Any]] = {}
    lines = ["| policy | page tokens | wall s | requests | CHR | TTFT p50 | TTFT p95 | e2e p95 |",
             "|---|---|---|---|---|---|---|---|"]
    for policy in ("coding-agent", "consistent-hash"):
        for page in (None, 512):
            started = time.perf_counter()
            sim = ClusterSimulator(SimConfig(replicas=50, sessions=250, duration_s=duration_s, seed=1,
                                             page_tokens=page), policy, load_workload("coding-agent"))
            r = sim.run()
            wall = time.perf_counter() - started
            rows[f"{policy}@{page or 64}"] = r
            lines.append(f"| {policy} | {page or 64} | {wall:.1f} | {r['requests_ok']} | "
                         f"{r['cache_hit_rate']:.4f} | {r['ttft_p50_s']:.3f} | {r['ttft_p95_s']:.3f} | "
                         f"{r['e2e_p95_s']:.2f} |")
    return "\n".join(lines), rows


def performance(replicas: int = 1000, sessions: int = 5000, duration_s: float = 600.0) -> tuple[str, dict[str, Any]]:
    lines = ["| page tokens | wall s | events | events/s | requests measured |", "|---|---|---|---|---|"]
    rows = {}
    for page in (512, None):
        started = time.perf_counter()
        sim = ClusterSimulator(SimConfig(replicas=replicas, sessions=sessions, duration_s=duration_s,
                                         seed=1, page_tokens=page), "coding-agent", load_workload("coding-agent"))
        result = sim.run()
        wall = time.perf_counter() - started
        rows[page or 64] = {"wall_s": wall, "events": sim.events, "events_per_s": sim.events / wall,
                            "requests": result["requests_ok"] + result["requests_failed"]}
        lines.append(f"| {page or 64} | {wall:.1f} | {sim.events:,} | {sim.events / wall:,.0f} | "
                     f"{rows[page or 64]['requests']:,} |")
    head = (f"{replicas} replicas x {sessions} sessions x {duration_s:.0f} simulated s, coding-agent, "
            "one core (`kvrouter simulate --replicas 1000 --sessions 5000 --duration 600 --seed 1 --page-tokens 512`):")
    return head + "\n\n" + "\n".join(lines), rows


def charts(out_dir: Path, textbook_rows: dict[str, Any], scale_rows: dict[str, Any], at_s: float = 300.0) -> list[str]:
    """Two small PNGs for docs/simulation.md; skipped (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=80)
    top = 14
    xs = list(range(top + 1))
    poisson = [math.exp(-5) * 5**k / math.factorial(k) for k in xs]
    ax.plot(xs, poisson, "k--", label="Poisson(5)")
    for policy, row in textbook_rows.items():
        counts = row["sessions_per_replica_at_end"]
        ax.plot(xs, [sum(1 for c in counts if c == k) / len(counts) for k in xs], marker="o", label=policy)
    ax.set_xlabel("sessions on a replica (250 sessions, 50 replicas)")
    ax.set_ylabel("fraction of replicas")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "textbook_sessions_per_replica.png")
    plt.close(fig)
    names.append("textbook_sessions_per_replica.png")
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(6, 4.8), dpi=80, sharex=True)
    for policy, row in scale_rows.items():
        t = [x[0] for x in row["timeline"]]
        a1.plot(t, [x[1] for x in row["timeline"]], marker=".", label=policy)
        a2.plot(t, [x[2] for x in row["timeline"]], marker=".", label=policy)
    for ax in (a1, a2):
        ax.axvline(at_s, color="grey", linestyle=":")
    a1.set_ylabel("cache-hit rate")
    a2.set_ylabel("TTFT p95 (s)")
    a2.set_xlabel("simulated time (s); 40 -> 50 replicas at the dotted line")
    a1.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "scale_out_timeline.png")
    plt.close(fig)
    names.append("scale_out_timeline.png")
    return names


def kept_sections(old: str) -> list[tuple[str, str]]:
    """The `KEPT_SECTIONS` of a previous doc, as (title, body), each up to the next `## `."""
    out = []
    for chunk in ("\n" + old).split("\n## ")[1:]:
        title, _, body = chunk.partition("\n")
        if title.strip() in KEPT_SECTIONS:
            out.append((title.strip(), body.strip()))
    return out


def replace_sections(doc: str, fresh: dict[str, str]) -> str:
    """`doc` with the bodies of the `## ` sections titled in `fresh` replaced, in place; titles it
    lacks are appended; everything else (the header included) is kept as it was."""
    head, *chunks = ("\n" + doc).split("\n## ")
    fresh = dict(fresh)
    body = []
    for chunk in chunks:
        title, _, text = chunk.partition("\n")
        body.append((title.strip(), fresh.pop(title.strip(), text.strip())))
    body += list(fresh.items())
    return head.strip() + "\n\n" + "\n\n".join(f"## {t}\n\n{b}" for t, b in body) + "\n"


def rerun_sections(args: argparse.Namespace) -> int:
    """`--only`: re-run some sections and replace just those in `--out` (and their numbers in
    simulation/scenarios.json); every other section, the header included, stays as it was."""
    only = [name.strip() for name in args.only.split(",")]
    unknown = [name for name in only if name not in ONLY_SECTIONS]
    if unknown:
        print(f"scenarios: --only: unknown section(s) {', '.join(unknown)} (known: {', '.join(ONLY_SECTIONS)})",
              file=sys.stderr)
        return 2
    runners = {
        "claude-code": ("Claude Code replay: 15 sessions x 2 users on 4 replicas", "claude_code",
                        lambda: claude_code(args.traces)),
        "resolution": ("Simulation resolution: 64- vs 512-token pages (50 replicas x 250 sessions)", "resolution", resolution),
        "performance": ("Performance", "performance", performance),
    }
    command = "python -m kvrouter.loadtest.scenarios " + " ".join(sys.argv[1:])
    fresh: dict[str, str] = {}
    numbers: dict[str, Any] = {}
    for name in only:
        title, key, run = runners[name]
        text, numbers[key] = run()
        fresh[title] = f"{text}\n\nRe-run alone with `{command.strip()}`."
        print(f"## {title}\n\n{fresh[title]}\n")
    if args.out:
        old = args.out.read_text() if args.out.exists() else ""
        args.out.write_text(replace_sections(old, fresh))
        path = args.out.parent / "simulation" / "scenarios.json"
        saved = json.loads(path.read_text()) if path.exists() else {}
        save_results(path, {**saved, **numbers})
    return 0


def save_results(path: Path, results: dict[str, Any]) -> None:
    """The numbers behind the doc's tables, as JSON (`timeline` tuples become lists)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


# The sections `--only` can re-run alone (the textbook and scale-out ones also draw charts).
ONLY_SECTIONS = ("claude-code", "resolution", "performance")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds, skip the 1000-replica run")
    parser.add_argument("--traces", type=Path, default=SHARED_TRACES)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", help=f"comma-separated sections to re-run ({', '.join(ONLY_SECTIONS)}); "
                                       "with --out the others are carried over from the file unchanged")
    args = parser.parse_args()
    if args.only:
        return rerun_sections(args)
    parts = []
    results: dict[str, Any] = {}
    text, textbook_rows = textbook(seeds=3 if args.quick else 10)
    parts.append(("Textbook check: 250 sessions on 50 replicas", text))
    scale_text, scale_rows = scale_out()
    results.update(textbook=textbook_rows, scale_out=scale_rows)
    if args.out:
        for name in charts(args.out.parent / "simulation", textbook_rows, scale_rows):
            if name.startswith("textbook"):
                parts[-1] = (parts[-1][0], parts[-1][1] + f"\n\n![sessions per replica](simulation/{name})")
            else:
                scale_text += f"\n\n![scale-out timeline](simulation/{name})"
    parts.append(("Scale-out: 40 -> 50 replicas at t=300 s (two-minute windows either side)", scale_text))
    if args.traces.is_dir():
        text, results["claude_code"] = claude_code(args.traces)
        parts.append(("Claude Code replay: 15 sessions x 2 users on 4 replicas", text))
    if not args.quick:
        text, results["resolution"] = resolution()
        parts.append(("Simulation resolution: 64- vs 512-token pages (50 replicas x 250 sessions)", text))
        text, results["performance"] = performance()
        parts.append(("Performance", text))
    if args.out and args.out.exists():
        parts.extend(kept_sections(args.out.read_text()))
    command = "python -m kvrouter.loadtest.scenarios " + " ".join(sys.argv[1:])
    header = (f"# Fleet-scale simulation\n\nGenerated by `{command.strip()}` on a {os.cpu_count()}-core "
              f"machine, Python {platform.python_version()} (one core per simulation). Every table "
              "comes from the discrete-event simulator running the real policy objects and the "
              "replica model (`kimi-k2.6-b200-tp4` profile, coding-agent workload unless noted).")
    doc = header + "\n\n" + "\n\n".join(f"## {title}\n\n{body}" for title, body in parts)
    print(doc)
    if args.out:
        args.out.write_text(doc + "\n")
        save_results(args.out.parent / "simulation" / "scenarios.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
