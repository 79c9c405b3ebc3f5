"""Data-plane overhead, measured side by side in one run: direct to the upstream vs through kvrouter.

Starts benchmarks/upstream.py and `kvrouter serve` as separate processes on 127.0.0.1, then
interleaves the two targets request by request so machine noise hits both alike.
Reports streaming time-to-first-byte (C=1, keep-alive aiohttp client) and non-streaming
requests/s at C=16, each as a ratio to direct.

    python benchmarks/dataplane.py [--requests 300] [--seconds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
CHAT = {"model": "bench", "messages": [{"role": "user", "content": "hello"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def process(args: list[str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    """Run a server process until the block ends; wait until its port accepts connections."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{' '.join(args)} did not start") from None
                time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def ttfb_once(session: aiohttp.ClientSession, url: str) -> float:
    start = time.perf_counter()
    async with session.post(url, json={**CHAT, "stream": True, "chunks": 20}) as resp:
        await resp.content.readuntil(b"\n\n")
        first = time.perf_counter() - start
        await resp.read()
    return first


async def streaming_ttfb(targets: dict[str, str], n: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {name: [] for name in targets}
    async with aiohttp.ClientSession() as session:
        for url in targets.values():  # warm the keep-alive connections
            await ttfb_once(session, url)
        for _ in range(n):
            for name, url in targets.items():
                results[name].append(await ttfb_once(session, url))
    return results


async def rps(url: str, concurrency: int, seconds: float) -> float:
    done = 0
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                async with session.post(url, json=CHAT) as resp:
                    await resp.read()
                done += 1
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


async def measure(upstream: str, router: str, args: argparse.Namespace) -> dict[str, object]:
    targets = {"direct": upstream + "/v1/chat/completions",
               "kvrouter": router + "/v1/chat/completions"}
    ttfb = await streaming_ttfb(targets, args.requests)
    rates: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(args.rounds):  # alternate so drift hits both
        for name, url in targets.items():
            rates[name].append(await rps(url, 16, args.seconds))
    out: dict[str, object] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    for name in targets:
        out[name] = {
            "ttfb_p50_ms": statistics.median(ttfb[name]) * 1e3,
            "ttfb_p99_ms": pct(ttfb[name], 0.99) * 1e3,
            "rps_c16": statistics.median(rates[name]),
        }
    d, r = out["direct"], out["kvrouter"]
    assert isinstance(d, dict) and isinstance(r, dict)
    out["added_ttfb_p50_ms"] = r["ttfb_p50_ms"] - d["ttfb_p50_ms"]
    out["added_ttfb_p99_ms"] = r["ttfb_p99_ms"] - d["ttfb_p99_ms"]
    out["ttfb_p50_ratio"] = r["ttfb_p50_ms"] / d["ttfb_p50_ms"]
    out["rps_ratio"] = r["rps_c16"] / d["rps_c16"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="streaming TTFB samples per target")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one C=16 rate run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating C=16 runs per target")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    up_port, router_port = free_port(), free_port()
    upstream, router = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{router_port}"
    with process([sys.executable, str(HERE / "upstream.py"), str(up_port)], up_port), \
         process([sys.executable, "-m", "kvrouter.cli", "serve", "--replica", upstream,
                  "--port", str(router_port)], router_port):
        result = asyncio.run(measure(upstream, router, args))
    d, r = result["direct"], result["kvrouter"]
    print(f"{'':10} {'TTFB p50 ms':>12} {'TTFB p99 ms':>12} {'req/s C=16':>11}")
    for name in ("direct", "kvrouter"):
        row = result[name]
        assert isinstance(row, dict)
        print(f"{name:10} {row['ttfb_p50_ms']:12.2f} {row['ttfb_p99_ms']:12.2f} {row['rps_c16']:11.0f}")
    print(f"added TTFB: p50 {result['added_ttfb_p50_ms']:+.2f} ms, p99 {result['added_ttfb_p99_ms']:+.2f} ms;"
          f" TTFB ratio {result['ttfb_p50_ratio']:.2f}x; req/s ratio {result['rps_ratio']:.2f}x of direct")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
