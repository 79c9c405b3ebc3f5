"""Overhead of one shadow policy per decision on replayed real coding-agent sessions, 100 replicas.

benchmarks/shadow.py times shadows on a synthetic mix (half new sessions, prompts nobody else
holds). This one times them where the decisions come from real traffic: the cluster simulator
replays the committed Claude Code traces (`benchmarks/traces`, its `set2` and `set3`; each file
`--copies` times, as that many users) through the live router's own `RoutingEngine` on 100
simulated replicas, so the mix of rules (affinity, rehome_evicted, new sessions, empty replicas),
the KV index's matches (system prompts every replica holds) and the replicas' changing views are
what a live router at that scale sees. At every decision the engine's notes are worked out twice
on the decision's own snapshot, without and with the shadow, before the decision is committed;
which of the two runs first alternates, so neither gets the other's warm caches. The overhead is
the difference of the two: the mean difference per decision (what the shadow costs the process)
and the difference of the two medians, overall and by the rule the shadow's own decision took.

The cyclic garbage collector is paused while the notes are timed (`--keep-gc` leaves it on): a
young collection that falls there scans the simulator's own young objects (its replica models'
pages and events), which a router does not have, and lands on whichever allocation crosses the
threshold. The allocations still count, so collections run soon after, untimed. With it on,
each row also counts the collections that fell in each timed call and gives the overhead less
their pauses; benchmarks/shadow_collections.py counts whether a shadow adds any.

One process's figures move run to run by more than the differences worth measuring (its hash
seed lays out every dict differently, and with it what is cold when). `--runs N` measures each
pair in N fresh interpreters, one at a time and the pairs in turn, and reports every run and,
per pair, the mean, lowest and highest over them.

    python benchmarks/shadow_traces.py [--pairs consistent-hash:coding-agent,...] [--copies 8]
        [--stagger-s 2] [--duration-s 3600] [--keep-gc] [--runs 1]
        [--json docs/benchmarks-shadow-traces.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections import defaultdict
from pathlib import Path

# benchmarks/ is on sys.path: this runs as a script
from portable import code_version, machine_facts, portable, portable_command

from kvrouter.loadtest.cluster_config import SimConfig
from kvrouter.loadtest.cluster_sim import ClusterSimulator
from kvrouter.loadtest.trace_claude_code import claude_code_arrivals
from kvrouter.loadtest.workload_config import load_workload
from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.policies.registry import build_policy

TRACES = Path(__file__).resolve().parent / "traces"
TRACE_SETS = (TRACES, TRACES / "set2", TRACES / "set3")
PAIRS = (("consistent-hash", "coding-agent"), ("coding-agent", "consistent-hash"),
         ("coding-agent", "prefix-aware"))
REPLICAS = 100


def replay_of(primary: str, copies: int, stagger_s: float, duration_s: float) -> tuple[list, ClusterSimulator]:  # type: ignore[type-arg]
    """The committed traces' sessions (`copies` users per file) and the simulator that replays
    them through `primary` on REPLICAS replicas; shared with benchmarks/shadow_collections.py."""
    arrivals = claude_code_arrivals(TRACE_SETS, copies=copies, stagger_s=stagger_s, max_context_tokens=262_144)
    config = SimConfig(replicas=REPLICAS, duration_s=duration_s, seed=1, warmup_s=0.0, warm_start=False)
    sim = ClusterSimulator(config, primary, load_workload("coding-agent"), arrivals=arrivals)
    sim.engine.metrics = RouterMetrics()  # the live router counts shadow metrics; so does this
    return arrivals, sim


def measure(primary: str, shadow: str, copies: int, stagger_s: float, duration_s: float,
            keep_gc: bool = False) -> dict[str, object]:
    arrivals, sim = replay_of(primary, copies, stagger_s, duration_s)
    engine = sim.engine
    with_shadow = ((shadow, build_policy(shadow)),)
    commit = engine.commit
    clock = time.perf_counter
    # Per decision: the shadow's rule and the seconds without and with it. Kept in arrays of
    # floats and a list of the policies' own reason strings, not a tuple per decision: objects
    # kept to the end count towards the collector's threshold, and ~13,000 tuples would set off
    # passes of their own in the run being measured.
    rules: list[str] = []
    without_s, with_s = array("d"), array("d")
    pauses = _Pauses(clock)  # collections falling inside the timed notes (--keep-gc)

    def timed_commit(decision, summary, session, **kw):  # type: ignore[no-untyped-def]
        if kw.get("target") is None:
            snapshot = engine._snapshot(session)  # what `commit` notes on: nothing changed since
            first_with = not len(rules) % 2
            if not keep_gc:
                gc.disable()  # see the module's docstring
            try:
                for shadows in ((with_shadow, ()) if first_with else ((), with_shadow)):
                    pauses.region = bool(shadows)
                    t0 = clock()
                    notes = engine.notes(snapshot, summary, decision, shadows)
                    took = clock() - t0
                    pauses.region = None
                    if shadows:
                        with_s.append(took)
                        other = notes.shadows[0][1]
                    else:
                        without_s.append(took)
            finally:
                pauses.region = None
                if not keep_gc:
                    gc.enable()
            rules.append(other.reason if other is not None else "none")
        return commit(decision, summary, session, **kw)

    engine.commit = timed_commit  # every decision the simulator commits is timed here first
    gc.callbacks.append(pauses.hook)
    started = time.perf_counter()
    try:
        sim.run()
    finally:
        gc.callbacks.remove(pauses.hook)
    wall = time.perf_counter() - started

    def summary_of(picked: list[int]) -> dict[str, object]:
        without = [without_s[i] * 1e6 for i in picked]
        with_ = [with_s[i] * 1e6 for i in picked]
        return {"decisions": len(picked),
                "overhead_mean_us": round(statistics.fmean(with_) - statistics.fmean(without), 2),
                "overhead_p50_us": round(statistics.median(with_) - statistics.median(without), 2),
                "notes_without_shadow_mean_us": round(statistics.fmean(without), 2),
                "notes_without_shadow_p50_us": round(statistics.median(without), 2)}

    by_rule: dict[str, list[int]] = defaultdict(list)
    for i, rule in enumerate(rules):
        by_rule[rule].append(i)
    overall = summary_of(list(range(len(rules))))
    collected = {}
    if keep_gc:  # where the collections fell, and the overhead less their pauses
        paused_us = (pauses.in_region[True] - pauses.in_region[False]) / len(rules) * 1e6
        collected = {"collections_in_timed_notes": {"without_shadow": pauses.counts[False],
                                                    "with_shadow": pauses.counts[True]},
                     "collections_whole_run": pauses.total,
                     "overhead_mean_us_less_collections": round(
                         (statistics.fmean(with_s) - statistics.fmean(without_s)) * 1e6 - paused_us, 2)}
    return {"primary": primary, "shadow": shadow, "sessions": len(arrivals),
            "requests_in_traces": sum(s.n_turns for _, s in arrivals),
            "simulated_s": duration_s, "wall_s": round(wall, 1), **overall, **collected,
            "by_shadow_rule": {rule: summary_of(picked)
                               for rule, picked in sorted(by_rule.items(), key=lambda kv: -len(kv[1]))}}


class _Pauses:
    """A `gc.callbacks` hook: every collection's pause, summed per timed region (`region`: False
    while the notes are worked out without the shadow, True with it, None elsewhere), and the
    whole run's collections and their summed pauses (seconds) per generation."""

    def __init__(self, clock) -> None:  # type: ignore[no-untyped-def]
        self.clock = clock
        self.region: bool | None = None
        self.in_region = {False: 0.0, True: 0.0}
        self.counts = {False: 0, True: 0}
        self.total: dict[str, int] = {}
        self.paused: dict[str, float] = {}
        self._started = 0.0

    def hook(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = self.clock()
            return
        pause = self.clock() - self._started
        generation = str(info["generation"])
        self.total[generation] = self.total.get(generation, 0) + 1
        self.paused[generation] = self.paused.get(generation, 0.0) + pause
        if self.region is not None:
            self.in_region[self.region] += pause
            self.counts[self.region] += 1


def measure_fresh(pair: str, args: argparse.Namespace) -> dict[str, object]:
    """`measure` of one `primary:shadow` pair in a fresh interpreter (its own hash seed and heap)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # each run its own seed
        subprocess.run([sys.executable, str(Path(__file__).resolve()), *_options(args, pair), "--json", str(out)],
                       check=True, stdout=subprocess.DEVNULL, env=env)
        row: dict[str, object] = json.loads(out.read_text())["rows"][0]
        return row


def _options(args: argparse.Namespace, pairs: str) -> list[str]:
    """Every option of one measurement spelled out (not --runs, not --json): what the saved
    command says and what each fresh interpreter of `--runs` is given."""
    return ["--pairs", pairs, "--copies", str(args.copies), "--stagger-s", _number(args.stagger_s),
            "--duration-s", _number(args.duration_s), *(["--keep-gc"] if args.keep_gc else [])]


def _number(x: float) -> str:
    """`x` short (2, not 2.0) where that reads back as the same float, else in full."""
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


def spread(rows: list[dict[str, object]]) -> dict[str, object]:
    """Per figure of one pair's runs: each run's value, and their mean, lowest and highest."""
    out: dict[str, object] = {"runs": len(rows)}
    for key in ("overhead_mean_us", "overhead_p50_us", "notes_without_shadow_mean_us",
                "overhead_mean_us_less_collections"):
        if key not in rows[0]:  # collector-on runs only
            continue
        values = [float(r[key]) for r in rows]  # type: ignore[arg-type]
        out[key] = {"each": values, "mean": round(statistics.fmean(values), 2), "min": min(values),
                    "max": max(values)}
    return out


def add_replay_options(ap: argparse.ArgumentParser) -> None:
    """The replay's options, shared with benchmarks/shadow_collections.py."""
    ap.add_argument("--pairs", default=",".join(f"{p}:{s}" for p, s in PAIRS),
                    help="primary:shadow pairs, comma-separated")
    ap.add_argument("--copies", type=int, default=8, help="users per trace file")
    ap.add_argument("--stagger-s", type=float, default=2.0, help="between top-level sessions' starts")
    ap.add_argument("--duration-s", type=float, default=3600.0, help="simulated time")


def check_pairs(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """`--pairs`, each `primary:shadow` of known policies, before anything is measured (not in a
    run's interpreter halfway through); a bad one ends the program with the reason."""
    pairs = text.split(",")
    for pair in pairs:
        names = pair.split(":")
        if len(names) != 2:
            ap.error(f"--pairs: {pair!r} is not primary:shadow")
        for name in names:
            try:
                build_policy(name)
            except (KeyError, ValueError) as err:  # unknown policy or preset: the registry says which
                ap.error(f"--pairs: {name!r}: {err}")
    return pairs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_replay_options(ap)
    ap.add_argument("--keep-gc", action="store_true", help="leave the garbage collector on while timing")
    ap.add_argument("--runs", type=int, default=1,
                    help="above 1: each pair measured in this many fresh interpreters, in turn")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    code = code_version()
    load_before = os.getloadavg()  # the machine may be shared: say how busy it was
    pairs = check_pairs(ap, args.pairs)
    rows = []
    print("| run | primary | shadow | decisions | overhead mean us | overhead p50 us | notes alone mean us "
          "| by the shadow's rule: decisions, mean us |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for run in range(1, args.runs + 1):
        for pair in pairs:
            if args.runs == 1:
                primary, shadow = pair.split(":")
                row = measure(primary, shadow, args.copies, args.stagger_s, args.duration_s, args.keep_gc)
            else:
                row = {"run": run, **measure_fresh(pair, args)}
            rows.append(row)
            rules = "; ".join(f"{rule} {r['decisions']}, {r['overhead_mean_us']:.1f}"
                              for rule, r in row["by_shadow_rule"].items())  # type: ignore[union-attr]
            print(f"| {run} | {row['primary']} | {row['shadow']} | {row['decisions']} | {row['overhead_mean_us']:.1f} | "
                  f"{row['overhead_p50_us']:.1f} | {row['notes_without_shadow_mean_us']:.1f} | {rules} |", flush=True)
    by_pair = []
    if args.runs > 1:
        keys = ["overhead_mean_us", "overhead_p50_us", *(["overhead_mean_us_less_collections"] if args.keep_gc else [])]
        print("\nEach cell: the mean over the runs (lowest-highest).\n")
        print("| primary | shadow | runs | overhead mean us | overhead p50 us |"
              + (" overhead mean us less the collections' pauses |" if args.keep_gc else ""))
        print("|---|---|---:|" + "---|" * len(keys))
        for pair in pairs:
            primary, shadow = pair.split(":")
            summary = spread([r for r in rows if (r["primary"], r["shadow"]) == (primary, shadow)])
            by_pair.append({"primary": primary, "shadow": shadow, **summary})
            cells = " | ".join(f"{m['mean']:.1f} ({m['min']:.1f}-{m['max']:.1f})"
                               for m in (summary[k] for k in keys))  # type: ignore[index]
            print(f"| {primary} | {shadow} | {args.runs} | {cells} |")
    if args.json:
        # Every option spelled out, as run from the repository's root whatever the working directory was.
        command = ["python", "benchmarks/shadow_traces.py", *_options(args, args.pairs),
                   *(["--runs", str(args.runs)] if args.runs > 1 else []),
                   "--json", portable(str(Path(args.json).resolve()))]
        out = {"command": portable_command(command), "code": code,
               "replicas": REPLICAS, "copies": args.copies, "stagger_s": args.stagger_s,
               "gc_paused_while_timed": not args.keep_gc, "runs": args.runs, **machine_facts(load_before),
               "rows": rows, **({"by_pair": by_pair} if by_pair else {})}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
