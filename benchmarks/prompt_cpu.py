"""Router CPU per request: the next turn of a ~400 KB conversation vs a 1 KB request, in one run.

Starts one upstream (benchmarks/upstream.py, aiohttp: SSE answers and a /metrics page with the
KV capacity, nothing else) and two
`kvrouter serve` processes in front of it: one as configured by default, one with
`routing.prefix_chain_cache_mb: 0` (every prompt parsed and hashed whole, as before). One
client sends, one request at a time on a keep-alive connection, batches of

  small     a 1 KB chat request (a new conversation each time);
  small-keyed  the same with an `x-session-id` header (a new session each time): the
            baseline of `keyed`, since a session key costs the same whatever the prompt's size;
  append    the next turn of one of `--sessions` conversations that start at ~400 KB: the previous
            prompt plus an assistant reply and a user message (~2 KB), no session key;
  keyed     the same with an `x-session-id` header (other conversations);

to each router, in rotating order so machine noise hits all alike, and reads each router
process's CPU time around every batch: /proc utime + stime (clock ticks, 10 ms) and the
scheduler's own account in nanoseconds (/proc/PID/task/*/schedstat), which a batch of 50 requests
resolves to well under a microsecond. The upstream reports a KV capacity
(`--capacity-tokens`) that holds all the conversations, so the shadow index sees each turn as an
append to what the replica caches, not a prompt its LRU evicted since the last turn. Streaming
requests without `stream_options`, as coding agents send them (the router asks for the usage
event).

    python benchmarks/prompt_cpu.py [--json docs/benchmarks-prompt-cpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from dataplane import kvrouter_cmd, machine, process  # noqa: E402
from dp_scenarios import CHAT_PATH, Conversation, code_text  # noqa: E402
from portable import portable_command  # noqa: E402
from kvrouter.loadtest.process_group import free_port  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of the (single) process `pid`, from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK


def runtime_ns(pid: int) -> int:
    """CPU time of every thread of `pid` in nanoseconds, from the scheduler's account."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def body(messages: list[dict[str, str]]) -> bytes:
    return orjson.dumps({"model": "bench", "messages": messages, "stream": True, "max_tokens": 4})


class Client:
    """Sequential requests on one keep-alive connection per router; returns latency."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def send(self, payload: bytes, headers: dict[str, str]) -> float:
        start = time.perf_counter()
        self.conn.request("POST", CHAT_PATH, body=payload,
                          headers={"Content-Type": "application/json", **headers})
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200 or not data.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"unexpected answer {resp.status}: {data[:200]!r}")
        return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start-kb", type=int, default=400, help="conversation size at its first turn")
    parser.add_argument("--turn-kb", type=float, default=2.0, help="bytes each turn adds, KB")
    parser.add_argument("--sessions", type=int, default=4, help="conversations per kind")
    parser.add_argument("--batch", type=int, default=40, help="requests per batch")
    parser.add_argument("--rounds", type=int, default=5, help="batches per (router, kind)")
    parser.add_argument("--capacity-tokens", type=int, default=2_000_000,
                        help="the KV capacity the upstream reports (max_total_num_tokens): enough to "
                             "hold every conversation, as on a replica where they hit the cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    kinds = ("small", "small-keyed", "append", "keyed")
    routers = ("kvrouter", "kvrouter-whole-hash")
    # Each router gets its own conversations (a router's chain store only sees its own traffic).
    convs = {(r, k): [Conversation(rng, args.start_kb * 1000, int(args.turn_kb * 1000))
                      for _ in range(args.sessions)]
             for r in routers for k in ("append", "keyed")}
    counters = {(r, k): 0 for r in routers for k in kinds}

    def request(router: str, kind: str) -> tuple[bytes, dict[str, str]]:
        n = counters[router, kind]
        counters[router, kind] += 1
        if kind in ("small", "small-keyed"):
            payload = body([{"role": "user", "content": f"{n} " + code_text(rng, 1000)}])
            return payload, ({"x-session-id": f"{router}-small-{n}"} if kind == "small-keyed" else {})
        session = n % args.sessions
        payload = body(convs[router, kind][session].next_turn())
        return payload, ({"x-session-id": f"{router}-{session}"} if kind == "keyed" else {})

    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    result: dict[str, Any] = {"command": portable_command(sys.argv), "machine": machine(),
                              "when": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": vars(args)}
    cpu = {(r, k): [0.0, 0.0] for r in routers for k in kinds}  # user, system
    runtime = {(r, k): 0 for r in routers for k in kinds}  # ns, schedstat
    latency: dict[tuple[str, str], list[float]] = {(r, k): [] for r in routers for k in kinds}
    sizes: dict[str, list[int]] = {k: [] for k in kinds}
    with contextlib.ExitStack() as stack:
        stack.enter_context(process([sys.executable, str(HERE / "upstream.py"), str(up_port),
                                     "--server", "aiohttp", "--max-total-num-tokens",
                                     str(args.capacity_tokens)], up_port, "upstream"))
        whole = Path(tempfile.mkdtemp(prefix="prompt-cpu-")) / "router.yaml"
        whole.write_text(json.dumps({"routing": {"prefix_chain_cache_mb": 0}}))
        pids, clients = {}, {}
        for name, extra in (("kvrouter", ()), ("kvrouter-whole-hash", ("--config", str(whole)))):
            port = free_port()
            pids[name] = stack.enter_context(process(kvrouter_cmd(upstream, port, *extra), port, name)).pid
            clients[name] = Client(port)
        for name in routers:  # warm: connections, first (whole-hash) turn of every conversation
            for kind in kinds:
                for _ in range(args.sessions):
                    clients[name].send(*request(name, kind))
        order = [(r, k) for r in routers for k in kinds]
        for rnd in range(args.rounds):
            for router, kind in order[rnd % len(order):] + order[:rnd % len(order)]:
                batch = [request(router, kind) for _ in range(args.batch)]
                sizes[kind].extend(len(p) for p, _ in batch)
                user, system = cpu_times(pids[router])
                ran = runtime_ns(pids[router])
                for payload, headers in batch:
                    latency[router, kind].append(clients[router].send(payload, headers))
                runtime[router, kind] += runtime_ns(pids[router]) - ran
                user_after, system_after = cpu_times(pids[router])
                cpu[router, kind][0] += user_after - user
                cpu[router, kind][1] += system_after - system
    n = args.rounds * args.batch
    rows: dict[str, Any] = {}
    for router in routers:
        rows[router] = {kind: {"cpu_us_per_request": sum(cpu[router, kind]) / n * 1e6,
                               "user_us_per_request": cpu[router, kind][0] / n * 1e6,
                               "system_us_per_request": cpu[router, kind][1] / n * 1e6,
                               "runtime_us_per_request": runtime[router, kind] / n / 1e3,
                               "latency_p50_ms": statistics.median(latency[router, kind]) * 1e3,
                               "requests": n} for kind in kinds}
        for measure, suffix in (("cpu_us_per_request", ""), ("runtime_us_per_request", "_runtime")):
            small = rows[router]["small"][measure]
            for kind in ("append", "keyed"):
                rows[router][kind]["ratio_to_small" + suffix] = (
                    rows[router][kind][measure] / small if small else float("nan"))
            small_keyed = rows[router]["small-keyed"][measure]
            rows[router]["keyed"]["ratio_to_small_keyed" + suffix] = (
                rows[router]["keyed"][measure] / small_keyed if small_keyed else float("nan"))
    result["request_bytes"] = {k: {"min": min(v), "max": max(v)} for k, v in sizes.items()}
    result["routers"] = rows
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    for router in routers:
        row = rows[router]
        print(f"{router:20} " + "  ".join(
            f"{k} {row[k]['cpu_us_per_request']:.0f} us/req"
            f" (user {row[k]['user_us_per_request']:.0f}; runtime {row[k]['runtime_us_per_request']:.0f};"
            f" p50 {row[k]['latency_p50_ms']:.2f} ms)"
            + (f" {row[k]['ratio_to_small']:.2f}x small (runtime {row[k]['ratio_to_small_runtime']:.2f}x)"
               if k in ("append", "keyed") else "")
            for k in kinds)
            + f"  keyed/small-keyed runtime {row['keyed']['ratio_to_small_keyed_runtime']:.2f}x")
    print(f"request bytes: {result['request_bytes']}; load average start {result['machine']['loadavg_at_start']}"
          f" end {result['machine']['loadavg_at_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
