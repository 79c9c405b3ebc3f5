"""Overhead of one shadow policy per decision at 100 replicas (p50/p99 microseconds; target < 20 us).

On the loaded fleet of benchmarks/placement.py (polled signals, homed sessions, 100k-token
prefixes in the index), each decision's snapshot and filled-in summary are handed to
`RoutingEngine.notes` twice: with no shadow (what the decision log alone costs: the live pick's
prediction) and with one shadow policy (its decision, its prediction, its metric counts).
The difference of the two is the shadow's overhead. Half the requests are returning sessions, half
new ones, as in the placement benchmark. As in the live router, each request changes the registry:
its pick is dispatched and the request dispatched `IN_FLIGHT` decisions earlier completes, so two
replicas' views change per decision and every decision gets a new snapshot. A policy's kept
per-view terms (`ReplicaView.cost_terms`) last as long as their view, as they do live.

A shadow policy that is also the primary reuses the per-view cost terms the primary just computed
on the same views: coding-agent as a shadow of coding-agent is the cheapest case, not the
realistic one. The default pairs also measure coding-agent shadowing consistent-hash (a shadow
differs from the primary), whose row is the one the target applies to.

    python benchmarks/shadow.py [--replicas 100] [--decisions 4000] [--repeats 5]
        [--pairs coding-agent:round-robin,consistent-hash:coding-agent] [--json docs/benchmarks-shadow.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

from dp_scenarios import pct  # benchmarks/ is on sys.path: this runs as a script
from placement import build, random_prompt
from portable import code_version, machine_facts, portable, portable_command

from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.policies.domain import RequestSummary
from kvrouter.policies.registry import build_policy

SHADOWS = ("prefix-aware", "consistent-hash", "least-load", "round-robin", "coding-agent")
# (primary, shadow): every shadow behind the default primary, and coding-agent behind another one.
PAIRS = tuple(("coding-agent", shadow) for shadow in SHADOWS) + (("consistent-hash", "coding-agent"),)
IN_FLIGHT = 8  # requests in flight: each decision's dispatch completes this many decisions later


def measure(n: int, shadow: str, decisions: int, repeats: int, primary: str = "coding-agent") -> dict[str, object]:
    rng = random.Random(n)
    engine, sessions = build(n, primary, rng)
    engine.metrics = RouterMetrics()  # the live router counts shadow metrics; so does this
    with_shadow = ((shadow, build_policy(shadow)),)
    clock = time.perf_counter
    blocks = []
    in_flight: deque[str] = deque()
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
            # Untimed: a dispatch, and an earlier request's completion, change two views.
            engine.registry.dispatched(decision.replica, summary.prompt_tokens)
            in_flight.append(decision.replica)
            if len(in_flight) > IN_FLIGHT:
                engine.registry.completed(in_flight.popleft(), summary.prompt_tokens)
        blocks.append((pct(base_us, 0.5), pct(base_us, 0.99), pct(shadow_us, 0.5), pct(shadow_us, 0.99),
                       *(pct(kind[1], 0.5) - pct(kind[0], 0.5) for kind in by_kind.values())))
    base50, base99, with50, with99, new50, returning50 = (statistics.median(col) for col in zip(*blocks))
    return {"replicas": n, "primary": primary, "shadow": shadow, "notes_without_shadow_p50_us": base50,
            "notes_without_shadow_p99_us": base99, "notes_with_shadow_p50_us": with50,
            "notes_with_shadow_p99_us": with99, "shadow_overhead_p50_us": with50 - base50,
            "shadow_overhead_p99_us": with99 - base99,
            # The two halves apart: a new session costs a placement, a returning one goes home.
            "shadow_overhead_p50_us_new_sessions": new50,
            "shadow_overhead_p50_us_returning_sessions": returning50}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=100)
    ap.add_argument("--pairs", default=",".join(f"{p}:{s}" for p, s in PAIRS),
                    help="primary:shadow pairs, comma-separated")
    ap.add_argument("--decisions", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    code = code_version()
    load_before = os.getloadavg()  # the machine may be shared: say how busy it was
    print("| primary | shadow | overhead p50 us | new sessions | returning | overhead p99 us | notes alone p50 us |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for pair in args.pairs.split(","):
        primary, shadow = pair.split(":")
        row = measure(args.replicas, shadow, args.decisions, args.repeats, primary)
        rows.append(row)
        print(f"| {primary} | {shadow} | {row['shadow_overhead_p50_us']:.1f} | "
              f"{row['shadow_overhead_p50_us_new_sessions']:.1f} | "
              f"{row['shadow_overhead_p50_us_returning_sessions']:.1f} | {row['shadow_overhead_p99_us']:.1f} | "
              f"{row['notes_without_shadow_p50_us']:.1f} |", flush=True)
    if args.json:
        # Every option spelled out, as run from the repository's root whatever the working directory was.
        command = ["python", "benchmarks/shadow.py", "--replicas", str(args.replicas), "--pairs", args.pairs,
                   "--decisions", str(args.decisions), "--repeats", str(args.repeats),
                   "--json", portable(str(Path(args.json).resolve()))]
        out = {"command": portable_command(command), "code": code, "replicas": args.replicas,
               "decisions": args.decisions, "repeats": args.repeats, **machine_facts(load_before), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
