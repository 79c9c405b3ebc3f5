"""Overhead of one shadow policy per decision at 100 replicas (p50/p99 microseconds; target < 20 us).

On the loaded fleet of benchmarks/placement.py (polled signals, homed sessions, 100k-token
prefixes in the index), each decision's snapshot and filled-in summary are handed to
`RoutingEngine.notes` twice: with no shadow (what the decision log alone costs: the live pick's
prediction) and with one shadow policy (its decision, its prediction, its two metric updates).
The difference of the two is the shadow's overhead. Half the requests are returning sessions, half
new ones, as in the placement benchmark. As in the live router, where each dispatch changes the
registry, every decision gets a new snapshot: nothing a policy memoises on one snapshot (its fleet
scan) carries over to the next decision.

    python benchmarks/shadow.py [--replicas 100] [--decisions 4000] [--repeats 5] [--json docs/benchmarks-shadow.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from dp_scenarios import pct  # benchmarks/ is on sys.path: this runs as a script
from placement import build, random_prompt

from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.policies.domain import RequestSummary
from kvrouter.policies.registry import build_policy

SHADOWS = ("prefix-aware", "consistent-hash", "least-load", "round-robin", "coding-agent")


def measure(n: int, shadow: str, decisions: int, repeats: int) -> dict[str, object]:
    rng = random.Random(n)
    engine, sessions = build(n, "coding-agent", rng)
    engine.metrics = RouterMetrics()  # the live router counts shadow metrics; so does this
    with_shadow = ((shadow, build_policy(shadow)),)
    clock = time.perf_counter
    blocks = []
    for _ in range(repeats):
        base_us: list[float] = []
        shadow_us: list[float] = []
        by_kind: dict[str, tuple[list[float], list[float]]] = {"new": ([], []), "returning": ([], [])}
        for i in range(decisions):
            if i % 2:
                key, prefix = sessions[rng.randrange(len(sessions))]
            else:
                key, prefix = f"new-{rng.getrandbits(64)}", random_prompt(rng)
            summary = RequestSummary("/v1/chat/completions", session_key=key,
                                     prompt_tokens=100_000, prefix_blocks=prefix)
            snapshot, filled = engine.prepare(summary, engine.table.view(key))
            decision = engine.policy.decide(snapshot, filled, engine.rng)
            assert decision is not None
            engine.shadows = ()
            t0 = clock()
            engine.notes(snapshot, filled, decision)
            base_us.append((clock() - t0) * 1e6)
            engine.shadows = with_shadow
            t0 = clock()
            engine.notes(snapshot, filled, decision)
            shadow_us.append((clock() - t0) * 1e6)
            kind = by_kind["returning" if i % 2 else "new"]
            kind[0].append(base_us[-1])
            kind[1].append(shadow_us[-1])
            engine.registry.dispatched(decision.replica, 0)  # untimed: the next decision's
            engine.registry.completed(decision.replica, 0)  # snapshot is a new one, as live
        blocks.append((pct(base_us, 0.5), pct(base_us, 0.99), pct(shadow_us, 0.5), pct(shadow_us, 0.99),
                       *(pct(kind[1], 0.5) - pct(kind[0], 0.5) for kind in by_kind.values())))
    base50, base99, with50, with99, new50, returning50 = (statistics.median(col) for col in zip(*blocks))
    return {"replicas": n, "shadow": shadow, "notes_without_shadow_p50_us": base50,
            "notes_without_shadow_p99_us": base99, "notes_with_shadow_p50_us": with50,
            "notes_with_shadow_p99_us": with99, "shadow_overhead_p50_us": with50 - base50,
            "shadow_overhead_p99_us": with99 - base99,
            # The two halves apart: a new session costs a placement, a returning one goes home.
            "shadow_overhead_p50_us_new_sessions": new50,
            "shadow_overhead_p50_us_returning_sessions": returning50}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=100)
    ap.add_argument("--shadows", default=",".join(SHADOWS))
    ap.add_argument("--decisions", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    load_before = os.getloadavg()  # the machine may be shared: say how busy it was
    print("| shadow | overhead p50 us | new sessions | returning | overhead p99 us | notes alone p50 us |")
    print("|---|---:|---:|---:|---:|---:|")
    for shadow in args.shadows.split(","):
        row = measure(args.replicas, shadow, args.decisions, args.repeats)
        rows.append(row)
        print(f"| {shadow} | {row['shadow_overhead_p50_us']:.1f} | "
              f"{row['shadow_overhead_p50_us_new_sessions']:.1f} | "
              f"{row['shadow_overhead_p50_us_returning_sessions']:.1f} | {row['shadow_overhead_p99_us']:.1f} | "
              f"{row['notes_without_shadow_p50_us']:.1f} |", flush=True)
    if args.json:
        out = {"replicas": args.replicas, "decisions": args.decisions, "repeats": args.repeats,
               "python": sys.version.split()[0], "cpus": os.cpu_count(),
               "load_average_1m": {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)},
               "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
