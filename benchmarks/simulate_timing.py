"""Time one `kvrouter simulate` run and write its timing as JSON.

Runs the simulator in a child process (the checkout's own `python -m kvrouter.cli`), takes the
event count and the simulator's own wall time from the line it prints per policy, and records the
load average before and after (the machine may be shared: read wall times next to it).

    python benchmarks/simulate_timing.py --out docs/simulation/perf-1000x5000-timing.json -- \\
        --replicas 1000 --sessions 5000 --duration 600 --seed 1 --policy coding-agent \\
        --json docs/simulation/perf-1000x5000.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

_EVENTS = re.compile(r"^(?P<policy>\S+): (?P<events>\d+) events in (?P<wall>[\d.]+) s", re.M)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="timing JSON to write")
    parser.add_argument("sim_args", nargs=argparse.REMAINDER, help="arguments after --")
    args = parser.parse_args()
    sim_args = [a for a in args.sim_args if a != "--"] if args.sim_args[:1] == ["--"] else args.sim_args
    load_before = os.getloadavg()
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "kvrouter.cli", "simulate", *sim_args],
        capture_output=True, text=True, check=True,
    )
    wall = time.perf_counter() - started
    load_after = os.getloadavg()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    runs = [
        {"policy": m["policy"], "events": int(m["events"]), "wall_s": float(m["wall"]),
         "events_per_s": round(int(m["events"]) / float(m["wall"]))}
        for m in _EVENTS.finditer(proc.stderr)  # the simulator reports there
    ]
    timing = {
        "command": "kvrouter simulate " + " ".join(sim_args),
        "runs": runs,  # per policy: the simulator's own count and wall time of its event loop
        "process_wall_s": round(wall, 1),  # the whole process, start-up and report included
        "process_cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "max_rss_mb": round(usage.ru_maxrss / 1024),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
    }
    Path(args.out).write_text(json.dumps(timing, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
