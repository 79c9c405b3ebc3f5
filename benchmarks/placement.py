"""Cost of one placement decision at 8, 100 and 1000 replicas (p50/p99 microseconds).

Times `policy.decide` alone and the router's whole synchronous step (`RoutingEngine.decide`: KV
index match + snapshot + policy) on a loaded fleet: every replica with polled signals and homed
sessions, the index holding each session's 100k-token prefix (64-token blocks, as the live router).

    python benchmarks/placement.py [--policy coding-agent] [--decisions 4000] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from dp_scenarios import pct  # benchmarks/ is on sys.path: this runs as a script

from kvrouter.sglang_protocol.signals import ReplicaSignals
from kvrouter.policies.domain import RequestSummary, SessionView
from kvrouter.policies.registry import build_policy
from kvrouter.router.engine import RoutingEngine
from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.router.sessions import SessionTable

PROMPT_TOKENS = 100_000
BLOCK_TOKENS = 64


def build(n: int, policy: str, rng: random.Random) -> tuple[RoutingEngine, list[tuple[str, tuple[int, ...]]]]:
    registry = ReplicaRegistry([f"http://replica-{i}:30000" for i in range(n)])
    table = SessionTable()
    engine = RoutingEngine(build_policy(policy), registry, ShadowKVIndex(BLOCK_TOKENS), table, rng)
    sessions = []
    for i, url in enumerate(registry.urls()):
        registry.update_signals(url, ReplicaSignals(
            num_running_reqs=rng.randrange(0, 30), num_queue_reqs=rng.randrange(0, 2),
            token_usage=rng.random() * 0.8, max_total_num_tokens=444_672))
        for s in range(3):  # three warm sessions per replica
            key = f"s{i}-{s}"
            blocks = random_prompt(rng)
            engine.index.record(url, blocks)
            table.acquire(key, 0)
            table.assign(key, url, force=False, tokens=PROMPT_TOKENS, now=0)
            table.release(key, 0)
            sessions.append((key, blocks))
    return engine, sessions


def random_prompt(rng: random.Random) -> tuple[int, ...]:
    """The block hashes of a new 100k-token prompt nobody has seen."""
    return tuple(rng.getrandbits(63) for _ in range(PROMPT_TOKENS // BLOCK_TOKENS))


def timed_step(engine: RoutingEngine, key: str, blocks: tuple[int, ...],
               ) -> tuple[float, RequestSummary, SessionView | None]:
    """The router's whole synchronous step for one request: (microseconds, the summary with the
    index match filled in, the session view it was given)."""
    summary = RequestSummary("/v1/chat/completions", session_key=key,
                             prompt_tokens=PROMPT_TOKENS, prefix_blocks=blocks)
    view = engine.table.view(key)
    t0 = time.perf_counter()
    _, filled = engine.decide(summary, view)
    return (time.perf_counter() - t0) * 1e6, filled, view


def measure(n: int, policy: str, decisions: int, repeats: int) -> dict[str, float]:
    """p50/p99 of `repeats` blocks of `decisions` each on one fleet; the median block is reported,
    with the range of the p99s (a shared 2-vCPU VM moves tails a lot from block to block)."""
    rng = random.Random(n)
    engine, sessions = build(n, policy, rng)
    clock = time.perf_counter
    blocks_stats = []
    for _ in range(repeats):
        policy_us: list[float] = []
        engine_us: list[float] = []
        for i in range(decisions):
            if i % 2:  # a returning session (affinity path) ...
                key, blocks = sessions[rng.randrange(len(sessions))]
            else:  # ... or a new one (cost placement over the fleet)
                key, blocks = f"new-{rng.getrandbits(64)}", random_prompt(rng)
            us, filled, view = timed_step(engine, key, blocks)
            engine_us.append(us)
            snapshot = engine.registry.snapshot()  # exactly what the engine hands the policy
            snapshot = snapshot.with_session(view) if view is not None else snapshot
            t0 = clock()
            engine.policy.decide(snapshot, filled, engine.rng)
            policy_us.append((clock() - t0) * 1e6)
        blocks_stats.append((pct(policy_us, 0.5), pct(policy_us, 0.99), pct(engine_us, 0.5), pct(engine_us, 0.99)))
    median = [statistics.median(col) for col in zip(*blocks_stats)]
    return {"replicas": n, "policy_p50_us": median[0], "policy_p99_us": median[1],
            "engine_p50_us": median[2], "engine_p99_us": median[3],
            "policy_p99_range_us": [min(b[1] for b in blocks_stats), max(b[1] for b in blocks_stats)],
            "engine_p99_range_us": [min(b[3] for b in blocks_stats), max(b[3] for b in blocks_stats)]}


def machine_jitter(samples: int = 8000) -> dict[str, float]:
    """The same statistics for a fixed pure-Python loop as long as a new session's placement
    (~45 us): the tail this machine adds to any work of that size. On a VM, timer interrupts
    (every 4 ms at HZ=250) cost ~100-150 us each, so ~1% of 45 us samples carry one, which is
    exactly where p99 is read."""
    clock = time.perf_counter
    times = []
    for _ in range(samples):
        t0 = clock()
        total = 0
        for i in range(1500):
            total += i * i
        times.append((clock() - t0) * 1e6)
    return {"p50_us": pct(times, 0.5), "p99_us": pct(times, 0.99),
            "over_100us_share": sum(t > 100 for t in times) / len(times)}


def cold_memory_probe(idle_s: float = 5.0, lookups: int = 6000) -> dict[str, float]:
    """KV-index matches of returning sessions in the 1000-replica fleet, twice in a row (the
    second pass finds the same memory warm) and again after `idle_s` of idling: on this VM, memory
    left alone for seconds is slow to touch again."""
    rng = random.Random(7)
    engine, sessions = build(1000, "coding-agent", rng)
    picks = [sessions[rng.randrange(len(sessions))][1] for _ in range(lookups)]
    clock = time.perf_counter

    def p99_of_matches() -> float:
        times = []
        for blocks in picks:
            t0 = clock()
            engine.index.match(blocks, engine.match_limit)
            times.append((clock() - t0) * 1e6)
        return pct(times, 0.99)

    first = p99_of_matches()
    warm = p99_of_matches()
    time.sleep(idle_s)
    after_idle = p99_of_matches()
    return {"first_pass_p99_us": first, "warm_p99_us": warm, "after_idle_p99_us": after_idle,
            "idle_s": idle_s}


def allocation_probe(blocks_of_work: int = 30, per_block: int = 400) -> dict[str, float]:
    """The whole step at 1000 replicas, interleaved in small blocks: with each new request's block
    hashes built just before it (as the router does while parsing a request, and as `measure`
    does) and with the same hashes pre-built. The difference is what allocating ~60 KB of fresh
    objects right before the step costs it on this machine, not work the step does."""
    rng = random.Random(9)
    engine, sessions = build(1000, "coding-agent", rng)
    prebuilt = [random_prompt(rng) for _ in range(200)]
    times: dict[str, list[float]] = {"fresh": [], "prebuilt": []}
    for _ in range(blocks_of_work):
        for mode, out in times.items():
            for i in range(per_block):
                if i % 2:
                    key, blocks = sessions[rng.randrange(len(sessions))]
                elif mode == "fresh":
                    key, blocks = f"new-{rng.getrandbits(64)}", random_prompt(rng)
                else:
                    key, blocks = f"new-{rng.getrandbits(64)}", prebuilt[i % len(prebuilt)]
                out.append(timed_step(engine, key, blocks)[0])
    return {"fresh_p50_us": pct(times["fresh"], 0.5), "fresh_p99_us": pct(times["fresh"], 0.99),
            "prebuilt_p50_us": pct(times["prebuilt"], 0.5), "prebuilt_p99_us": pct(times["prebuilt"], 0.99)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="coding-agent")
    parser.add_argument("--decisions", type=int, default=4000, help="per block")
    parser.add_argument("--repeats", type=int, default=5, help="blocks per fleet size")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [measure(n, args.policy, args.decisions, args.repeats) for n in (8, 100, 1000)]
    jitter = machine_jitter()
    cold = cold_memory_probe()
    allocation = allocation_probe()
    print(f"policy {args.policy}: {args.repeats} blocks of {args.decisions} decisions per fleet size "
          f"(half returning sessions, half new); median block, p99 range over blocks")
    print(f"{'replicas':>8} {'decide p50 us':>14} {'decide p99 us':>22} {'+index p50 us':>14} {'+index p99 us':>22}")
    for r in rows:
        pr, er = r["policy_p99_range_us"], r["engine_p99_range_us"]
        print(f"{r['replicas']:>8} {r['policy_p50_us']:>14.1f} {r['policy_p99_us']:>8.1f} ({pr[0]:.0f}-{pr[1]:.0f}) "
              f"{r['engine_p50_us']:>14.1f} {r['engine_p99_us']:>8.1f} ({er[0]:.0f}-{er[1]:.0f})")
    print(f"machine jitter, a fixed pure-Python loop: p50 {jitter['p50_us']:.1f} us, p99 {jitter['p99_us']:.1f} us, "
          f"{jitter['over_100us_share']:.2%} of samples over 100 us")
    print(f"KV-index match at 1000 replicas, p99: first pass {cold['first_pass_p99_us']:.1f} us, same lookups again "
          f"{cold['warm_p99_us']:.1f} us, again after {cold['idle_s']:.0f} s idle {cold['after_idle_p99_us']:.1f} us")
    print(f"whole step at 1000 replicas, interleaved: request hashes built just before p50 "
          f"{allocation['fresh_p50_us']:.1f} / p99 {allocation['fresh_p99_us']:.1f} us, pre-built p50 "
          f"{allocation['prebuilt_p50_us']:.1f} / p99 {allocation['prebuilt_p99_us']:.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps({"policy": args.policy, "rows": rows, "machine_jitter": jitter,
                                               "cold_memory": cold, "allocation": allocation},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
