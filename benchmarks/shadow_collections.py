"""Does a shadow policy make the garbage collector run more often? Counted on replayed Claude Code sessions.

benchmarks/shadow_traces.py times a shadow's work at every decision. With the collector on, a
collection lands inside whichever timed call's allocation crosses the collector's threshold, and
the call that allocates a little more (the one with the shadow) catches more of them, although
they are due anyway: the simulator allocates between decisions too. What a shadow costs in
collections is the collections it adds to the process, so this counts them: each pair is replayed
(the same sessions, replicas and options as shadow_traces.py) in two fresh interpreters with the
same hash seed, so that both allocate alike but for the shadow: one works out each decision's notes
without the shadow, the other with it, once per decision as the live router does. A `gc.callbacks`
hook counts every collection by generation and sums its pause. Reported per run: both counts,
the collections the shadow added per generation, and what they cost per decision at the run's
mean pause of that generation (the simulator's heap makes its young collections slower than a
router's, so this errs high). Both sides must make the same decisions (a digest of every one is
compared). The count's resolution is one collection per replay (~12,900 decisions at the
defaults), and the simulator holds full collections off while it runs (loadtest/cluster_sim.py),
so generation 2 reads 0 on both sides.

    python benchmarks/shadow_collections.py [--pairs coding-agent:prefix-aware,...] [--copies 8]
        [--stagger-s 2] [--duration-s 3600] [--runs 3] [--json docs/benchmarks-shadow-collections.json]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

# benchmarks/ is on sys.path: this runs as a script
from portable import code_version, machine_facts, portable, portable_command
from shadow_traces import REPLICAS, _number, _Pauses, add_replay_options, check_pairs, replay_of

from kvrouter.policies.registry import build_policy


def replay(primary: str, shadow: str | None, copies: int, stagger_s: float, duration_s: float) -> dict[str, object]:
    """One replay, each decision's notes worked out once (with `shadow`, or none), the collector
    on; its collections per generation, their summed pauses and the notes' mean time."""
    _, sim = replay_of(primary, copies, stagger_s, duration_s)
    engine = sim.engine
    shadows = ((shadow, build_policy(shadow)),) if shadow else ()
    commit = engine.commit
    clock = time.perf_counter
    notes_s = array("d")  # floats, not objects the collector counts
    decided = hashlib.blake2b(digest_size=8)  # every decision, to prove both sides replayed alike
    pauses = _Pauses(clock)  # every collection of the run, per generation

    def noted_commit(decision, summary, session, **kw):  # type: ignore[no-untyped-def]
        if kw.get("target") is None:
            snapshot = engine._snapshot(session)
            t0 = clock()
            engine.notes(snapshot, summary, decision, shadows)
            notes_s.append(clock() - t0)
        decided.update(f"{decision.replica} {decision.reason}\n".encode())
        return commit(decision, summary, session, **kw)

    engine.commit = noted_commit
    gc.collect()  # both interpreters start from the same collected heap
    gc.callbacks.append(pauses.hook)
    try:
        sim.run()
    finally:
        gc.callbacks.remove(pauses.hook)
    return {"decisions": len(notes_s), "decisions_digest": decided.hexdigest(), "collections": pauses.total,
            "paused_ms": {g: round(s * 1e3, 2) for g, s in pauses.paused.items()},
            "notes_mean_us": round(statistics.fmean(notes_s) * 1e6, 2) if notes_s else None}


def paired(primary: str, shadow: str, hash_seed: int, args: argparse.Namespace) -> dict[str, object]:
    """`replay` without and with the shadow, each in a fresh interpreter with `hash_seed`."""
    sides = {}
    for side in ("without", "with"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "side.json"
            env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", side,
                            *_options(args, f"{primary}:{shadow}"), "--json", str(out)],
                           check=True, stdout=subprocess.DEVNULL, env=env)
            sides[side] = json.loads(out.read_text())
    without, with_ = sides["without"], sides["with"]
    if (without["decisions"], without["decisions_digest"]) != (with_["decisions"], with_["decisions_digest"]):
        raise RuntimeError(f"{primary}:{shadow}: the two replays decided differently")
    return {"primary": primary, "shadow": shadow, "hash_seed": hash_seed, "without_shadow": without,
            "with_shadow": with_, **added_by_shadow(without, with_)}


def added_by_shadow(without: dict, with_: dict) -> dict[str, object]:  # type: ignore[type-arg]
    """The collections the shadow added per generation, and their cost per decision at the two
    replays' mean pause of that generation."""
    decisions = max(1, without["decisions"])  # a replay too short to decide anything adds nothing
    added, cost_s = {}, 0.0
    for generation in sorted(set(without["collections"]) | set(with_["collections"])):
        n0, n1 = without["collections"].get(generation, 0), with_["collections"].get(generation, 0)
        added[generation] = n1 - n0
        pause_ms = (without["paused_ms"].get(generation, 0.0) + with_["paused_ms"].get(generation, 0.0)) / max(1, n0 + n1)
        cost_s += (n1 - n0) * pause_ms / 1e3
    return {"collections_added": added, "added_pause_us_per_decision": round(cost_s / decisions * 1e6, 2)}


def _options(args: argparse.Namespace, pairs: str) -> list[str]:
    return ["--pairs", pairs, "--copies", str(args.copies), "--stagger-s", _number(args.stagger_s),
            "--duration-s", _number(args.duration_s)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_replay_options(ap)
    ap.add_argument("--runs", type=int, default=3, help="pairs of replays per primary:shadow, hash seeds 1..N")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", choices=("without", "with"), help=argparse.SUPPRESS)  # one side of a pair
    args = ap.parse_args(argv)
    pairs = [pair.split(":") for pair in check_pairs(ap, args.pairs)]
    if args.child:
        if not args.json or len(pairs) != 1:
            ap.error("--child needs one pair and --json")
        ((primary, shadow),) = pairs
        result = replay(primary, shadow if args.child == "with" else None, args.copies, args.stagger_s,
                        args.duration_s)
        Path(args.json).write_text(json.dumps(result))
        return 0
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    code, load_before = code_version(), os.getloadavg()
    print("| run | primary | shadow | decisions | collections without / with the shadow (gen 0, 1, 2) "
          "| added | added pause per decision us |")
    print("|---|---|---|---:|---|---|---:|")
    rows = []
    for run in range(1, args.runs + 1):
        for primary, shadow in pairs:
            row = {"run": run, **paired(primary, shadow, run, args)}
            rows.append(row)

            def gens(counts: dict[str, int]) -> str:
                return ", ".join(str(counts.get(g, 0)) for g in ("0", "1", "2"))
            print(f"| {run} | {primary} | {shadow} | {row['without_shadow']['decisions']} | "  # type: ignore[index]
                  f"{gens(row['without_shadow']['collections'])} / {gens(row['with_shadow']['collections'])} | "  # type: ignore[index]
                  f"{gens(row['collections_added'])} | {row['added_pause_us_per_decision']:.2f} |", flush=True)  # type: ignore[arg-type]
    if args.json:
        command = ["python", "benchmarks/shadow_collections.py", *_options(args, args.pairs), "--runs", str(args.runs),
                   "--json", portable(str(Path(args.json).resolve()))]
        out = {"command": portable_command(command), "code": code, "replicas": REPLICAS, "copies": args.copies,
               "stagger_s": args.stagger_s, "duration_s": args.duration_s, "runs": args.runs,
               "gc_thresholds": gc.get_threshold(), **machine_facts(load_before), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
