"""Colocated vs prefill/decode-disaggregated vs DP-attention fleets of the same GPUs, live.

Starts simulated Kimi K2.6 replicas (8 x --pairs GPUs per fleet: 2 x pairs TP4 replicas, pairs
prefill + pairs decode servers, or 2 x pairs DP-attention replicas of 4 ranks), puts the seeded coding-agent workload through
kvrouter in front of each (and, with --smg PATH, through the SGLang gateway's PD mode on the PD
fleet), and writes one JSON file and a markdown table:

    python benchmarks/pd_fleets.py --out docs/disaggregation-live.json [--smg PATH]

The replicas are `kvrouter sim-replica` processes; each fleet starts fresh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvrouter.loadtest.driver import run_load
from kvrouter.loadtest.process_group import ProcessGroup, free_port, wait_ready

GPUS_PER_REPLICA = 4
COLOCATED = "kimi-k2.6-b200-tp4-fp8kv"
DP_RANK = "kimi-k2.6-b200-tp4-dp4-fp8kv"


@dataclass
class Fleet:
    name: str
    router: str  # "kvrouter" | "smg"
    replicas: list[list[str]] = field(default_factory=list)  # extra sim-replica flags per replica
    role: list[str] = field(default_factory=list)  # "replica" | "prefill" | "decode"


def fleets(with_smg: bool, pairs: int = 1) -> list[Fleet]:
    """Fleets of 8 x `pairs` GPUs."""
    n = 2 * pairs
    pd = f"{pairs}P + {pairs}D"
    out = [
        Fleet(f"colocated {n} x TP4", "kvrouter", [["--profile", COLOCATED]] * n, ["replica"] * n),
        Fleet(f"disaggregated {pd}", "kvrouter",
              [["--profile", COLOCATED, "--disaggregation-mode", "prefill"]] * pairs
              + [["--profile", COLOCATED, "--disaggregation-mode", "decode"]] * pairs,
              ["prefill"] * pairs + ["decode"] * pairs),
        Fleet(f"DP attention {n} x 4 ranks", "kvrouter",
              [["--profile", DP_RANK, "--dp-size", "4"]] * n, ["replica"] * n),
    ]
    if with_smg:
        out.append(Fleet(f"disaggregated {pd}, smg cache_aware", "smg", out[1].replicas, out[1].role))
    return out


async def run_fleet(fleet: Fleet, args: argparse.Namespace, group: ProcessGroup, tmp: Path) -> dict[str, Any]:
    urls, procs, bootstrap = [], [], {}
    for i, flags in enumerate(fleet.replicas):
        port = free_port()
        argv = [sys.executable, "-m", "kvrouter.cli", "sim-replica", "--host", "127.0.0.1",
                "--port", str(port), "--time-scale", f"{args.time_scale:g}", "--seed", str(i), *flags]
        if fleet.role[i] == "prefill":
            bootstrap[i] = free_port()
            argv += ["--disaggregation-bootstrap-port", str(bootstrap[i])]
        procs.append(group.start(f"replica{i}", argv))
        urls.append(f"http://127.0.0.1:{port}")
    rport = free_port()
    base = f"http://127.0.0.1:{rport}"
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(wait_ready(http, p, u, "/health", 60, lambda s: s == 200)
                               for p, u in zip(procs, urls)))
        prefill = [(u, bootstrap[i]) for i, u in enumerate(urls) if fleet.role[i] == "prefill"]
        decode = [u for i, u in enumerate(urls) if fleet.role[i] == "decode"]
        if fleet.router == "smg":
            argv = [args.smg, "launch", "--host", "127.0.0.1", "--port", str(rport), "--pd-disaggregation",
                    "--policy", "cache_aware"]
            for u, p in prefill:
                argv += ["--prefill", u, str(p)]
            for u in decode:
                argv += ["--decode", u]
            router = group.start("smg", argv)
            await wait_ready(http, router, base, "/health", 60, lambda s: s < 500)
        else:
            conf = tmp / f"router-{rport}.yaml"
            data: dict[str, Any] = {"server": {"host": "127.0.0.1", "port": rport}}
            if prefill:
                data["disaggregation"] = {"prefill": [f"{u}={p}" for u, p in prefill], "decode": decode}
            else:
                data["replicas"] = urls
            if "--dp-size" in fleet.replicas[0]:
                data["routing"] = {"dp_size": 4}
                data["signals"] = {"source": "loads"}
            conf.write_text(json.dumps(data))  # JSON is YAML
            router = group.start("kvrouter", [sys.executable, "-m", "kvrouter.cli", "serve", "--config", str(conf)])
            await wait_ready(http, router, base, "/ready", 60, lambda s: s == 200)
    t0 = time.monotonic()
    report = await run_load(
        base, "coding-agent", args.users, args.duration, seed=args.seed, time_scale=args.time_scale,
        replica_metrics_urls=urls, contender=fleet.name, ramp_s=args.ramp, warmup_s=args.warmup,
    )
    group.stop(group.procs[-(len(urls) + 1):])
    result = report["results"][fleet.name]
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["gpus"] = GPUS_PER_REPLICA * len(urls)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--smg", help="the SGLang gateway's smg executable: also run its PD mode")
    p.add_argument("--pairs", type=int, default=1, help="fleet size: 8 x PAIRS GPUs")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--duration", type=float, default=40.0, help="wall seconds of load per fleet")
    p.add_argument("--time-scale", type=float, default=5.0)
    p.add_argument("--ramp", type=float, default=40.0, help="model seconds over which users start")
    p.add_argument("--warmup", type=float, default=40.0, help="model seconds left out")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvrouter-pd-") as tmpdir:
        group = ProcessGroup(Path(tmpdir))
        try:
            for fleet in fleets(args.smg is not None, args.pairs):
                print(f"[pd_fleets] {fleet.name} ...", file=sys.stderr)
                results[fleet.name] = asyncio.run(run_fleet(fleet, args, group, Path(tmpdir)))
        finally:
            group.close()
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "smg")}
    Path(args.out).write_text(json.dumps({"settings": settings, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
