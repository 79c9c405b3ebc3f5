"""How the demo's verdict depends on its load: the cluster simulator at the demo's size, with
the traffic the live demo sends, at several user counts and many seeds.

For each user count and seed, runs

    kvrouter simulate --replicas 4 --sessions USERS --duration 200 --seed SEED --poll-interval 2
      --policies coding-agent,prefix_aware,consistent_hash --warm-start-as-driver --ramp 60
      --warmup 60 --eos-median 256 --json OUT/users-USERS-seed-SEED.json

(the values of loadtest/demo_settings.py: the demo's 4 replicas, 3.3 model minutes, ramp and
warm-up; the live signals' age at time scale 8; the load driver's warm start and reply lengths;
a seed's JSON already in OUT is read, not simulated again: empty OUT to rerun at another
commit), then prints per user count each
policy's mean over the seeds and the number of seeds in which it was best (a tie counts for each
tied policy), and writes that table to OUT/summary.json.

    python benchmarks/demo_load.py [--users 12,16,20,24,32,40,48] [--seeds 12] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from portable import code_version, portable_command  # noqa: E402

from kvrouter.loadtest.demo_settings import (  # noqa: E402
    DEMO_DURATION_S, DEMO_POLICIES, DEMO_RAMP_S, DEMO_REPLICAS, DEMO_TIME_SCALE, DEMO_WARMUP_S)
from kvrouter.router.config import SignalsConfig  # noqa: E402

POLICIES = DEMO_POLICIES
# The demo's run in model seconds, and the age of the live signals there (a poll interval of wall
# time at its time scale).
MODEL_DURATION_S = DEMO_DURATION_S * DEMO_TIME_SCALE
POLL_INTERVAL_S = SignalsConfig().interval_s * DEMO_TIME_SCALE
EOS_MEDIAN = 256  # the simulated replica's reply-length median (SimReplica.output_len_median)
# (result key, higher is better)
METRICS = (("cache_hit_rate", True), ("ttft_p50_s", False), ("ttft_p95_s", False))


def simulate(users: int, seed: int, out: Path) -> dict[str, Any]:
    """One simulation's results per policy (run unless `out` already holds it)."""
    if not out.exists():
        subprocess.run(
            [sys.executable, "-m", "kvrouter.cli", "simulate", "--replicas", str(DEMO_REPLICAS),
             "--sessions", str(users), "--duration", f"{MODEL_DURATION_S:g}", "--seed", str(seed),
             "--poll-interval", f"{POLL_INTERVAL_S:g}", "--policies", ",".join(POLICIES), "--warm-start-as-driver",
             "--ramp", f"{DEMO_RAMP_S:g}", "--warmup", f"{DEMO_WARMUP_S:g}", "--eos-median", str(EOS_MEDIAN),
             "--json", str(out)],
            check=True, stdout=subprocess.DEVNULL,
        )
    return json.loads(out.read_text())["results"]


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy and metric: the mean over the seeds and the seeds in which it was best."""
    table: dict[str, dict[str, Any]] = {p: {} for p in POLICIES}
    for key, higher in METRICS:
        best = {p: 0 for p in POLICIES}
        for run in results:
            top = (max if higher else min)(run[p][key] for p in POLICIES)
            for p in POLICIES:  # a tie counts for each tied policy
                best[p] += run[p][key] == top
        for p in POLICIES:
            table[p][key] = {"mean": round(statistics.fmean(run[p][key] for run in results), 4),
                             "best_in": best[p]}
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", default="12,16,20,24,32,40,48")
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--out-dir", default="docs/simulation/demo-load")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    users = [int(u) for u in args.users.split(",")]
    rows = {}
    print(f"| users | {' | '.join(f'{k} ({p})' for k, _ in METRICS for p in POLICIES)} |")
    for u in users:
        results = [simulate(u, s, out_dir / f"users-{u}-seed-{s}.json") for s in range(args.seeds)]
        rows[u] = table = summarize(results)
        cells = [f"{table[p][k]['mean']:.3f} ({table[p][k]['best_in']})" for k, _ in METRICS for p in POLICIES]
        print(f"| {u} | {' | '.join(cells)} |", flush=True)
    summary = {"command": portable_command(sys.argv), "code": code_version(), "seeds": args.seeds, "policies": list(POLICIES),
               "users": {str(u): rows[u] for u in users}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
