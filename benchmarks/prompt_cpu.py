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
event). Each conversation's first two turns (a whole parse, then the one-off proof of its
stored prefix) are sent before measuring.

What is counted: all of a router process's CPU while its batch runs, the request's own work
(socket reads and writes in the kernel included) and whatever the process does meanwhile (its
replica polls, timers). Besides the totals over all rounds, each round gives a ratio per router
(append / small, from batches of the same round), reported as their median and range; and after
every round both routers sit idle for as long as the round's mean batch took, which measures
their background CPU rate: the ratios are given also with each batch's share of it (rate x the
batch's wall time) taken out.

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


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": [round(v, 3) for v in values]}


def per_round(rounds: dict[tuple[str, str], list[dict[str, float]]], idle: list[dict[str, float]],
              router: str, kinds: tuple[str, ...], batch: int) -> dict[str, Any]:
    """One router's CPU per request round by round (scheduler's account), as measured and with
    the router's background CPU taken out: its rate over the round's idle interval times the
    batch's wall time. Each round's ratios compare batches run minutes apart at most, so a
    slow drift of the machine cancels; their median and range are reported."""
    rate = [i["runtime_ns"] / i["wall_s"] for i in idle]  # background ns per second
    out: dict[str, Any] = {"background_us_per_s": spread([r / 1e3 for r in rate]),
                           "background_user_per_s": sum(i["user_s"] for i in idle)
                           / sum(i["wall_s"] for i in idle),
                           "background_system_per_s": sum(i["system_s"] for i in idle)
                           / sum(i["wall_s"] for i in idle)}
    measured = {k: [b["runtime_ns"] / batch / 1e3 for b in rounds[router, k]] for k in kinds}
    net = {k: [(b["runtime_ns"] - rate[i] * b["wall_s"]) / batch / 1e3
               for i, b in enumerate(rounds[router, k])] for k in kinds}
    for k in kinds:
        batches = rounds[router, k]
        out[k] = {"runtime_us_per_request": spread(measured[k]),
                  "background_us_per_request": spread([m - x for m, x in zip(measured[k], net[k])]),
                  "net_us_per_request": spread(net[k]),
                  "user_us_per_request": sum(b["user_s"] for b in batches) / len(batches) / batch * 1e6,
                  "system_us_per_request": sum(b["system_s"] for b in batches) / len(batches) / batch * 1e6}
    for kind, base in (("append", "small"), ("keyed", "small"), ("keyed", "small-keyed")):
        name = f"{kind}/{base}"
        out[name] = {
            "ratio": spread([a / b for a, b in zip(measured[kind], measured[base])]),
            "ratio_net_of_background": spread([a / b for a, b in zip(net[kind], net[base])]),
            "user_ratio": out[kind]["user_us_per_request"] / out[base]["user_us_per_request"]
            if out[base]["user_us_per_request"] else float("nan"),
            "system_ratio": out[kind]["system_us_per_request"] / out[base]["system_us_per_request"]
            if out[base]["system_us_per_request"] else float("nan")}
    return out


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
    parser.add_argument("--sessions", type=int, default=16,
                        help="conversations per kind: more keep each one nearer its start size "
                             "(each grows by rounds x batch / sessions turns)")
    parser.add_argument("--batch", type=int, default=40, help="requests per batch")
    parser.add_argument("--rounds", type=int, default=5, help="batches per (router, kind)")
    parser.add_argument("--capacity-tokens", type=int, default=8_000_000,
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
    cpu = {(r, k): [0.0, 0.0] for r in routers for k in kinds}  # user, system seconds
    runtime = {(r, k): 0 for r in routers for k in kinds}  # ns, schedstat
    # per round: the batch's schedstat ns, user and system seconds, wall seconds
    rounds: dict[tuple[str, str], list[dict[str, float]]] = {(r, k): [] for r in routers for k in kinds}
    idle: dict[str, list[dict[str, float]]] = {r: [] for r in routers}  # per round, per router
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
        # warm: connections, and the first two turns of every conversation (its first is parsed
        # and hashed whole, its second proves the stored prefix once): the batches then hold
        # only a conversation's steady-state turns
        for name in routers:
            for kind in kinds:
                for _ in range(2 * args.sessions):
                    clients[name].send(*request(name, kind))
        order = [(r, k) for r in routers for k in kinds]
        for rnd in range(args.rounds):
            walls = []
            for router, kind in order[rnd % len(order):] + order[:rnd % len(order)]:
                batch = [request(router, kind) for _ in range(args.batch)]
                sizes[kind].extend(len(p) for p, _ in batch)
                pid = pids[router]
                user, system = cpu_times(pid)
                ran, began = runtime_ns(pid), time.perf_counter()
                for payload, headers in batch:
                    latency[router, kind].append(clients[router].send(payload, headers))
                wall = time.perf_counter() - began
                ran = runtime_ns(pid) - ran
                user_after, system_after = cpu_times(pid)
                walls.append(wall)
                runtime[router, kind] += ran
                cpu[router, kind][0] += user_after - user
                cpu[router, kind][1] += system_after - system
                rounds[router, kind].append({"runtime_ns": ran, "user_s": user_after - user,
                                             "system_s": system_after - system, "wall_s": wall})
            # the routers' own background (polls, timers) over an idle interval as long as the
            # round's mean batch: its rate, times a batch's wall time, is what a batch carries
            interval = statistics.fmean(walls)
            before = {r: (runtime_ns(pids[r]), *cpu_times(pids[r])) for r in routers}
            time.sleep(interval)
            for r in routers:
                ran0, user0, system0 = before[r]
                user1, system1 = cpu_times(pids[r])
                idle[r].append({"runtime_ns": runtime_ns(pids[r]) - ran0, "user_s": user1 - user0,
                                "system_s": system1 - system0, "wall_s": interval})
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
        rows[router]["per_round"] = per_round(rounds, idle[router], router, kinds, args.batch)
    result["request_bytes"] = {k: {"min": min(v), "mean": round(statistics.fmean(v)), "max": max(v)}
                               for k, v in sizes.items()}
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
        rr = row["per_round"]
        print(f"{'':20} per round (median [min-max]), background "
              f"{rr['background_us_per_s']['median']:.0f} us/s idle: " + "  ".join(
                  f"{name} {rr[name]['ratio']['median']:.2f}x [{rr[name]['ratio']['min']:.2f}-"
                  f"{rr[name]['ratio']['max']:.2f}], net of background "
                  f"{rr[name]['ratio_net_of_background']['median']:.2f}x "
                  f"[{rr[name]['ratio_net_of_background']['min']:.2f}-"
                  f"{rr[name]['ratio_net_of_background']['max']:.2f}]"
                  f" (user {rr[name]['user_ratio']:.2f}x, system {rr[name]['system_ratio']:.2f}x)"
                  for name in ("append/small", "keyed/small", "keyed/small-keyed")))
    print(f"request bytes: {result['request_bytes']}; load average start {result['machine']['loadavg_at_start']}"
          f" end {result['machine']['loadavg_at_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
