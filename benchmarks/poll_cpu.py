"""A router's CPU while it serves nothing: what polling its replicas costs, all day long.

Starts `--replicas` simulated replicas (`kvrouter sim-replica`, idle), then, `--rounds` times, a
`kvrouter serve` of this checkout in front of them with the default signals settings (each
replica's /metrics scraped every 0.25 s) and one with `signals.interval_s` 10 s (what the router
costs with next to no polls), and reads each router's CPU from the scheduler's account
(/proc/PID/task/*/schedstat, nanoseconds) over `--seconds` after a `--settle` wait.

    python benchmarks/poll_cpu.py [--replicas 4] [--seconds 10] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dataplane import kvrouter_cmd, process  # noqa: E402
from portable import code_version, machine_facts, portable_command  # noqa: E402
from prompt_cpu import runtime_ns  # noqa: E402

from kvrouter.loadtest.process_group import free_port  # noqa: E402
from kvrouter.router.config import SignalsConfig  # noqa: E402

QUIET_INTERVAL_S = 10.0  # next to no polls: what the router costs without them
SETUPS = {"default": {}, "interval_10s": {"signals": {"interval_s": QUIET_INTERVAL_S}}}


def router_cpu_ms_per_s(urls: list[str], config: dict, settle_s: float, seconds: float) -> float:
    with tempfile.TemporaryDirectory(prefix="poll-cpu-") as tmp:
        path = Path(tmp) / "router.yaml"
        path.write_text(json.dumps(config))  # JSON is YAML
        port = free_port()
        replicas = [a for u in urls[1:] for a in ("--replica", u)]
        cmd = kvrouter_cmd(urls[0], port, "--host", "127.0.0.1", "--config", str(path), *replicas)
        with process(cmd, port, "router", check=False) as router:
            time.sleep(settle_s)
            before = runtime_ns(router.pid)
            time.sleep(seconds)
            return (runtime_ns(router.pid) - before) / seconds / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured per router and round")
    parser.add_argument("--settle", type=float, default=3.0, help="wait after the router listens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    load_before = os.getloadavg()
    results: dict[str, list[float]] = {name: [] for name in SETUPS}
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(args.replicas):
            port = free_port()
            stack.enter_context(process([sys.executable, "-m", "kvrouter.cli", "sim-replica", "--host", "127.0.0.1",
                                         "--port", str(port)], port, f"replica{i}", check=False))
            urls.append(f"http://127.0.0.1:{port}")
        for r in range(args.rounds):
            for name, config in SETUPS.items():
                value = router_cpu_ms_per_s(urls, config, args.settle, args.seconds)
                results[name].append(round(value, 3))
                print(f"round {r + 1} {name}: {value:.2f} ms of CPU per second", flush=True)
    # the scrapes the default setup makes a second more than the other (each replica once an interval)
    polls_per_s = args.replicas / SignalsConfig().interval_s - args.replicas / QUIET_INTERVAL_S
    summary = {name: {"median_ms_per_s": statistics.median(v), "rounds": v} for name, v in results.items()}
    # per scrape, with its share of the round's own work (timers, the round's end)
    per_poll = (summary["default"]["median_ms_per_s"] - summary["interval_10s"]["median_ms_per_s"]) / polls_per_s
    print(f"median: default {summary['default']['median_ms_per_s']:.2f} ms/s, "
          f"interval 10 s {summary['interval_10s']['median_ms_per_s']:.2f} ms/s; "
          f"~{per_poll * 1000:.0f} us per poll ({polls_per_s:g} polls a second more)")
    if args.json:
        out = {"command": portable_command(sys.argv), "code": code_version(), "machine": machine_facts(load_before),
               "when": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": vars(args), "results": summary,
               "us_per_poll": round(per_poll * 1000, 1)}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
