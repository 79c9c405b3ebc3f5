"""Data-plane overhead, measured side by side in ONE run: direct vs kvrouter vs any other router.

Starts one SGLang-shaped upstream (benchmarks/upstream.py: FastAPI + uvicorn, SGLang's own HTTP
stack, or aiohttp), `kvrouter serve`, `tcp-pump` (benchmarks/tcp_pump.py: a byte pump with no
HTTP in it, the floor any proxy on this machine pays for the extra hop) and every `--external`
router as separate processes on 127.0.0.1, then interleaves the targets request by request (or run by run, ABBA) so machine noise
hits all alike:

  (a) streaming C=1, 20 chunks: time to first byte and total, with aiohttp, async httpx and the
      synchronous OpenAI SDK (in a thread), each on keep-alive connections; (a') the same with
      ~400 KB prompts, each request the next turn of an append-only conversation;
  (b) streaming C=64, chunks paced 10 ms apart: per-chunk delivery latency (upstream write ->
      client read, same CLOCK_MONOTONIC) and inter-chunk gaps;
  (c) non-streaming C=16 requests/s (aiohttp and httpx clients);
  (d) many concurrent slow streams (fresh connections, 20 chunks/s each): each router's CPU
      seconds (/proc utime+stime, process tree) per 1000 relayed chunks;
  (e) with Redis available: kvrouter --workers 1 vs --workers 2 (Redis affinity, a session id
      per connection) requests/s, with a lean client and a raw upstream (a few us of CPU per
      request each) so that the router, not its neighbours, is what the 2 CPUs are busy with;
  (f) one placement decision at 8/100/1000 replicas (benchmarks/placement.py).

Prints ratios to direct and writes everything as JSON.

    python benchmarks/dataplane.py [--upstream uvicorn|aiohttp] [--json out.json] \
        [--external 'smg=smg launch --host 127.0.0.1 --port {port} --worker-urls {worker_urls} --policy round_robin']

`--external NAME=COMMAND TEMPLATE`: `{port}` is the port it must listen on, `{worker_urls}` the
upstream URL, `{python}` this interpreter; run without a shell.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dp_scenarios as sc  # noqa: E402
from portable import portable_command  # noqa: E402
from kvrouter.loadtest.process_group import free_port  # noqa: E402


def _ready(url: str) -> bool:
    """A non-streaming chat request answers 200 (a router may listen before its workers are up)."""
    req = urllib.request.Request(url + sc.CHAT_PATH, data=json.dumps(sc.CHAT).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def process(args: list[str], port: int, name: str, check: bool = True,
            env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run a server until the block ends; wait until it serves a chat request (or accepts)."""
    log = tempfile.NamedTemporaryFile(prefix=f"dataplane-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not (_ready(url) if check else _accepts(port)):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{name} ({' '.join(args)}) did not start; log: {log.name}")
            time.sleep(0.1)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)  # its own session: the launcher and any workers it forked
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(5)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


def kvrouter_cmd(upstream: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvrouter.cli", "serve", "--replica", upstream,
            "--port", str(port), *extra]


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import aiohttp

    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "kernel": platform.release(), "aiohttp": aiohttp.__version__,
            "loadavg_at_start": os.getloadavg()}


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


async def measure(args: argparse.Namespace, targets: dict[str, str],
                  pids: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {"loadavg_after": {}}  # the 1-minute load average after each section
    print("(a) streaming C=1 ...", flush=True)
    out["streaming_c1"] = await sc.streaming_c1(targets, args.requests, 20, args.clients)
    out["loadavg_after"]["streaming_c1"] = os.getloadavg()[0]
    if args.c1_only:
        return out
    if args.large_requests:
        print(f"(a') streaming C=1, ~{args.large_kb} KB append-only prompts ...", flush=True)
        out["streaming_c1_large"] = await sc.streaming_c1(targets, args.large_requests, 20, args.clients,
                                                          prompt_kb=args.large_kb)
        out["loadavg_after"]["streaming_c1_large"] = os.getloadavg()[0]
    print("(b) streaming C=64 paced ...", flush=True)
    out["paced_c64"] = await sc.paced_streams(targets, 64, args.paced_chunks, 10, args.paced_rounds)
    out["loadavg_after"]["paced_c64"] = os.getloadavg()[0]
    print("(c) non-streaming C=16 ...", flush=True)
    out["nonstreaming_c16"] = await sc.nonstreaming_rps(
        targets, 16, args.seconds, args.rounds, [c for c in args.clients if c != "openai"], pids)
    out["loadavg_after"]["nonstreaming_c16"] = os.getloadavg()[0]
    print(f"(d) {args.streams} slow streams ...", flush=True)
    slow: dict[str, Any] = {}
    for t, url in targets.items():
        slow[t] = await sc.slow_streams(url, pids[t], args.streams, args.slow_chunks, 50,
                                        args.stagger_ms / 1000)
    out["slow_streams"] = slow
    out["loadavg_after"]["slow_streams"] = os.getloadavg()[0]
    return out


def scaling(args: argparse.Namespace, upstream: str) -> dict[str, Any] | None:
    """kvrouter --workers 1 vs 2 with Redis affinity, non-streaming C=16, lean client (a session
    id per connection) against the raw upstream: the router is the bottleneck."""
    try:
        sys.path.insert(0, str(HERE.parent))
        from tests.redis_server import RedisProcess
    except ImportError as err:
        print(f"(e) skipped: no Redis helper ({err})")
        return None
    tmp = Path(tempfile.mkdtemp(prefix="dataplane-redis-"))
    redis = RedisProcess(tmp)
    try:
        redis.start()
    except Exception as err:  # noqa: BLE001 - a benchmark section is optional
        print(f"(e) skipped: no Redis server ({err})")
        return None
    try:
        cfg = tmp / "router.yaml"
        cfg.write_text(json.dumps({"affinity": {"store": "redis", "redis_url": redis.url}}))
        ports = {"kvrouter-w1": free_port(), "kvrouter-w2": free_port()}
        with contextlib.ExitStack() as stack:
            targets, pids = {}, {}
            for name, workers in (("kvrouter-w1", 1), ("kvrouter-w2", 2)):
                pids[name] = stack.enter_context(process(
                    kvrouter_cmd(upstream, ports[name], "--config", str(cfg), "--workers", str(workers)),
                    ports[name], name)).pid
                targets[name] = f"http://127.0.0.1:{ports[name]}"
            targets = {"direct": upstream, **targets}
            print("(e) kvrouter --workers 1 vs 2 (Redis affinity), non-streaming C=16, lean client ...",
                  flush=True)
            return asyncio.run(sc.nonstreaming_rps(targets, 16, args.seconds, args.rounds, ["lean"], pids))
    finally:
        redis.kill()


def placement() -> dict[str, Any]:
    """benchmarks/placement.py in a fresh process: this one's large heap would put its GC pauses
    into the placement percentiles."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, str(HERE / "placement.py"), "--json", out.name],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def report_c1(rows: dict[str, Any], title: str, others: list[str]) -> None:
    print(f"\n{title}, keep-alive: TTFB and total ms (added over direct)")
    for client, per in rows.items():
        d = per["direct"]
        print(f"  {client:8} direct TTFB p50 {d['ttfb']['p50_ms']:.2f} p99 {d['ttfb']['p99_ms']:.2f} "
              f"total p50 {d['total']['p50_ms']:.2f}")
        for n in others:
            r = per[n]
            print(f"  {'':8} {n:12} TTFB p50 {r['ttfb']['p50_ms']:.2f} ({r['ttfb']['p50_ms'] - d['ttfb']['p50_ms']:+.2f}) "
                  f"p99 {r['ttfb']['p99_ms']:.2f} ({r['ttfb']['p99_ms'] - d['ttfb']['p99_ms']:+.2f}) "
                  f"max {r['ttfb']['max_ms']:.1f}; total p50 {r['total']['p50_ms']:.2f} "
                  f"({r['total']['p50_ms'] - d['total']['p50_ms']:+.2f}) x{ratio(r['ttfb']['p50_ms'], d['ttfb']['p50_ms']):.2f} TTFB")


def report(result: dict[str, Any], names: list[str]) -> None:
    others = [n for n in names if n != "direct"]
    print(f"\nupstream: {result['upstream']}; machine: {result['machine']['cpus']} CPUs, "
          f"{result['machine']['cpu_model']}; load average (1 min) at start "
          f"{result['machine']['loadavg_at_start'][0]:.1f}, after each section "
          + ", ".join(f"{k} {v:.1f}" for k, v in result.get("loadavg_after", {}).items()))
    for key, title in (("streaming_c1", "(a) streaming C=1, 20 chunks"),
                       ("streaming_c1_large", "(a') the same, ~400 KB append-only prompts")):
        if key in result:
            report_c1(result[key], title, others)
    if "paced_c64" not in result:  # --c1-only
        return
    print("\n(b) streaming C=64, 10 ms pacing: chunk delivery latency ms (added over direct)")
    d = result["paced_c64"]["direct"]
    print(f"  direct       p50 {d['chunk_latency']['p50_ms']:.2f} p99 {d['chunk_latency']['p99_ms']:.2f}"
          f"  gap p99 {d['gap']['p99_ms']:.2f}")
    for n in others:
        r = result["paced_c64"][n]
        print(f"  {n:12} p50 {r['chunk_latency']['p50_ms']:.2f} ({r['chunk_latency']['p50_ms'] - d['chunk_latency']['p50_ms']:+.2f})"
              f" p99 {r['chunk_latency']['p99_ms']:.2f} ({r['chunk_latency']['p99_ms'] - d['chunk_latency']['p99_ms']:+.2f})"
              f"  gap p99 {r['gap']['p99_ms']:.2f}")
    print("\n(c) non-streaming C=16 requests/s (ratio to direct)")
    for client, per in result["nonstreaming_c16"].items():
        base = per["direct"]["rps"]
        print(f"  {client:8} " + "  ".join(
            f"{n} {per[n]['rps']:.0f} ({ratio(per[n]['rps'], base):.2f}x)" for n in names))
        print(f"  {'':8} CPU us/request (process tree; direct = upstream): " + "  ".join(
            f"{n} {per[n]['cpu_us_per_request'] or 0:.0f}" for n in names))
    print("\n(d) slow streams: CPU s per 1000 chunks (process tree; direct = the upstream itself)")
    for n in names:
        r = result["slow_streams"][n]
        print(f"  {n:12} {r['cpu_s_per_1000_chunks']:.3f} s/1000 chunks, {r['chunks_received']}/"
              f"{r['chunks_expected']} chunks, wall {r['wall_s']:.1f}s (ideal {r['ideal_wall_s']:.1f}s),"
              f" util {r['cpu_util']:.2f} cores")
    if result.get("workers_scaling"):
        per = result["workers_scaling"]["lean"]
        w1 = per["kvrouter-w1"]["rps"]
        print("\n(e) non-streaming C=16 requests/s, Redis affinity, lean client, raw upstream: " + "  ".join(
            f"{n} {v['rps']:.0f}" for n, v in per.items())
              + f"; 2 workers / 1 worker = {ratio(per['kvrouter-w2']['rps'], w1):.2f}x")
        print("    CPU us/request (router process tree): " + "  ".join(
            f"{n} {per[n]['cpu_us_per_request'] or 0:.0f}" for n in ("kvrouter-w1", "kvrouter-w2")))
    if result.get("placement"):
        print("\n(f) placement, coding-agent: " + "; ".join(
            f"{r['replicas']} replicas p50 {r['policy_p50_us']:.0f} us p99 {r['policy_p99_us']:.0f} us "
            f"(+index p99 {r['engine_p99_us']:.0f} us)" for r in result["placement"]["rows"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", choices=("uvicorn", "aiohttp"), default="uvicorn")
    parser.add_argument("--external", action="append", default=[], metavar="NAME=COMMAND",
                        help="another router: {port}, {worker_urls}, {python} are filled in")
    parser.add_argument("--clients", default="aiohttp,httpx,openai")
    parser.add_argument("--requests", type=int, default=200, help="(a) samples per client and target")
    parser.add_argument("--large-requests", type=int, default=60,
                        help="(a') samples per client and target with large prompts (0: skip)")
    parser.add_argument("--large-kb", type=int, default=400, help="(a') prompt size at the first turn, KB")
    parser.add_argument("--paced-chunks", type=int, default=50, help="(b) chunks per paced stream")
    parser.add_argument("--paced-rounds", type=int, default=3, help="(b) waves of 64 per target")
    parser.add_argument("--seconds", type=float, default=3.0, help="(c) length of one rate run")
    parser.add_argument("--rounds", type=int, default=4, help="(c) ABBA runs per target and client")
    parser.add_argument("--streams", type=int, default=1000, help="(d) concurrent slow streams")
    parser.add_argument("--slow-chunks", type=int, default=100, help="(d) chunks per slow stream")
    parser.add_argument("--stagger-ms", type=float, default=2.0, help="(d) gap between stream starts")
    parser.add_argument("--no-scaling", action="store_true", help="skip (e) --workers 1 vs 2")
    parser.add_argument("--no-placement", action="store_true", help="skip (f)")
    parser.add_argument("--c1-only", action="store_true",
                        help="only (a), streaming C=1 with small prompts (implies --no-scaling --no-placement)")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    if args.c1_only:
        args.no_scaling = args.no_placement = True
    args.clients = [c for c in args.clients.split(",") if c]
    if args.upstream == "uvicorn":
        try:
            import fastapi  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError:
            parser.error("--upstream uvicorn needs fastapi and uvicorn (pip install -e '.[bench]')")
    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    result: dict[str, Any] = {"command": portable_command(sys.argv),
                              "machine": machine(), "upstream": args.upstream,
                              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    with contextlib.ExitStack() as stack:
        procs = {"direct": stack.enter_context(process(
            [sys.executable, str(HERE / "upstream.py"), str(up_port), "--server", args.upstream],
            up_port, "upstream"))}
        targets = {"direct": upstream}
        port = free_port()
        procs["kvrouter"] = stack.enter_context(process(kvrouter_cmd(upstream, port), port, "kvrouter"))
        targets["kvrouter"] = f"http://127.0.0.1:{port}"
        port = free_port()
        procs["tcp-pump"] = stack.enter_context(process(
            [sys.executable, str(HERE / "tcp_pump.py"), str(port), upstream], port, "tcp-pump"))
        targets["tcp-pump"] = f"http://127.0.0.1:{port}"
        for spec in args.external:
            name, _, template = spec.partition("=")
            port = free_port()
            cmd = [a.format(port=port, worker_urls=upstream, python=sys.executable)
                   for a in shlex.split(template)]
            procs[name] = stack.enter_context(process(cmd, port, name))
            targets[name] = f"http://127.0.0.1:{port}"
        pids = {n: p.pid for n, p in procs.items()}
        result["targets"] = {n: portable_command(p.args) for n, p in procs.items()}  # type: ignore[arg-type]
        result.update(asyncio.run(measure(args, targets, pids)))
    if not args.no_scaling:
        with process([sys.executable, str(HERE / "upstream.py"), str(up_port), "--server", "raw"],
                     up_port, "upstream"):
            result["workers_scaling"] = scaling(args, upstream)
    if not args.no_placement:
        print("(f) placement ...", flush=True)
        result["placement"] = placement()
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    report(result, list(targets))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
