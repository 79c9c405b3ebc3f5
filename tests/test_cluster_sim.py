"""The cluster simulator: deterministic, drives the real policies, handles scale events."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvrouter.loadtest.cluster_sim import ClusterSimulator, ScaleEvent, SimConfig
from kvrouter.loadtest.report import RESULT_KEYS
from kvrouter.loadtest.workload import make_session, warm_start_batch
from kvrouter.loadtest.workload_config import load_workload

WL = load_workload("coding-agent")


def run(policy: str, **kw) -> tuple[ClusterSimulator, dict]:
    kw.setdefault("replicas", 8)
    kw.setdefault("duration_s", 240.0)
    kw.setdefault("seed", 3)
    sim = ClusterSimulator(SimConfig(**kw), policy, WL)
    return sim, sim.run()


def test_same_seed_gives_byte_identical_json(tmp_path: Path):
    outs = []
    for name, hash_seed in (("a.json", "1"), ("b.json", "2")):  # str hashing differs per process
        path = tmp_path / name
        subprocess.run([sys.executable, "-m", "kvrouter.cli", "simulate", "--replicas", "6",
                        "--duration", "120", "--policy", "coding-agent,consistent-hash",
                        "--seed", "5", "--json", str(path)], check=True, capture_output=True,
                       timeout=120, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        outs.append(path.read_bytes())
    assert outs[0] == outs[1]
    assert b'"schema": 1' in outs[0]


def test_results_follow_the_contract_and_affinity_keeps_cache():
    _, ca = run("coding-agent")
    _, rr = run("round-robin")
    for result in (ca, rr):
        assert all(key in result for key in RESULT_KEYS)
        assert result["requests_ok"] > 20 and result["requests_failed"] == 0
    assert ca["cache_hit_rate"] > rr["cache_hit_rate"] + 0.2
    assert sum(ca["decisions"].values()) >= ca["requests_ok"]


def test_measured_requests_are_broken_down_by_the_rule_that_placed_them():
    sim, result = run("coding-agent")
    by_reason = result["decisions_measured"]
    assert sum(r["requests"] for r in by_reason.values()) == result["requests_ok"] + result["requests_failed"]
    assert set(by_reason) <= set(sim.decisions)
    affinity = by_reason["affinity"]
    assert 0 < affinity["cache_hit_rate"] <= 1 and 0 < affinity["predicted_hit_rate"] <= 1
    # The prompt-weighted hit rates of the rules add up to the run's.
    prompt = sum(r["prompt_tokens"] for r in by_reason.values())
    hits = sum(r["cache_hit_rate"] * r["prompt_tokens"] for r in by_reason.values() if r["prompt_tokens"])
    assert abs(hits / prompt - result["cache_hit_rate"]) < 1e-3


def test_scale_out_sends_new_sessions_to_fresh_replicas():
    sim, result = run("coding-agent", replicas=6, sessions=40, duration_s=400.0,
                      scale_events=(ScaleEvent(120.0, add=2),))
    new = ("replica-0006", "replica-0007")
    assert all(url in sim.models for url in new)
    assert sum(sim.table.homed_sessions.get(u, 0) for u in new) > 0
    assert result["decisions"].get("fresh_replica", 0) + result["sessions_rebalanced"] > 0


def test_killed_replica_sessions_rehome_and_failures_are_counted():
    sim, result = run("coding-agent", replicas=6, sessions=30, duration_s=300.0,
                      scale_events=(ScaleEvent(150.0, remove=("replica-0000",)),))
    assert "replica-0000" not in sim.models
    records = [r for r in sim.records if r.replica == "replica-0000" and r.start_s >= 150.0]
    assert records == []  # nothing routed to it after it died
    assert result["decisions"].get("rehome", 0) > 0


def _first_turns(policy: str, **kw) -> dict[str, tuple[int, int]]:
    """Each of the 8 warm-started sessions' first request in the run: (turn index, prompt
    tokens). Sessions started later, as others end, are left out (none ends within the 15 s
    ramp, so with `warm_start_as_driver` the first 8 numbers are the users' too)."""
    sim = ClusterSimulator(SimConfig(replicas=2, sessions=8, duration_s=60.0, seed=4, warmup_s=0, **kw), policy, WL)
    sim.run()
    first: dict[str, tuple[float, int, int]] = {}
    for r in sim.records:
        if int(r.session_id.rsplit("-", 1)[1]) >= 8:
            continue
        if r.session_id not in first or r.start_s < first[r.session_id][0]:
            first[r.session_id] = (r.start_s, r.turn_index, r.prompt_tokens)
    return {sid: (turn, prompt) for sid, (_, turn, prompt) in first.items()}


def test_every_policy_gets_the_same_warm_start():
    """Warm-started sessions begin part-way through their turns; how far is drawn from the seed
    alone, never from the policy's name, or policies would be compared on different traffic."""
    turns = _first_turns("round-robin")
    assert len(turns) == 8
    assert any(turn > 0 for turn, _ in turns.values())  # the warm start did skip turns
    assert _first_turns("consistent-hash") == turns
    assert _first_turns("coding_agent") == turns


def test_warm_start_as_driver_is_the_load_drivers():
    """`warm_start_as_driver`: session i of a seed starts at the same turn in the simulator as in
    `kvrouter compare`'s driver (driver.py `user_loop`): the same seed is the same traffic."""
    turns = _first_turns("round-robin", warm_start_as_driver=True)
    assert turns != _first_turns("round-robin")  # the simulator's own draw, by default
    for i in range(8):
        session = make_session(WL, 4, i)
        batch = warm_start_batch(session, 4)
        turn, prompt = turns[session.session_id]  # one of the batch's branches
        assert turn == batch[0].turn_index and prompt in {r.prompt_tokens for r in batch}


def test_ramp_spreads_the_session_starts_over_that_long():
    def starts(**kw) -> list[float]:
        sim = ClusterSimulator(SimConfig(replicas=2, sessions=8, duration_s=100.0, seed=4, warmup_s=0, **kw),
                               "round-robin", WL)
        sim.run()
        first: dict[str, float] = {}
        for r in sim.records:
            if int(r.session_id.rsplit("-", 1)[1]) < 8:
                first[r.session_id] = min(r.start_s, first.get(r.session_id, r.start_s))
        return sorted(first.values())

    assert starts() == [25.0 * i / 8 for i in range(8)]  # default: a quarter of the duration
    assert starts(ramp_s=60.0) == [60.0 * i / 8 for i in range(8)]  # as compare's --ramp


def test_eos_median_ends_replies_as_sim_replicas_do_without_ignore_eos():
    """`eos_median`: each reply stops at a drawn EOS (never past max_tokens), the same for every
    policy; without it every reply is its max_tokens long."""
    def completions(policy: str, **kw) -> dict[tuple[str, int, int], tuple[int, int]]:
        sim = ClusterSimulator(SimConfig(replicas=2, sessions=8, duration_s=120.0, seed=4, warmup_s=0, **kw),
                               policy, WL)
        max_tokens: dict[tuple[str, int, int], int] = {}
        real_prepare = sim._prepare

        def prepare(idx, req):
            max_tokens[(req.session_id, req.turn_index, req.branch_index)] = req.max_tokens
            return real_prepare(idx, req)

        sim._prepare = prepare  # type: ignore[method-assign]
        sim.run()
        return {(r.session_id, r.turn_index, r.branch_index):
                (r.completion_tokens, max_tokens[(r.session_id, r.turn_index, r.branch_index)])
                for r in sim.records if r.ok}

    full = completions("round-robin")
    assert full and all(done == cap for done, cap in full.values())
    cut = completions("round-robin", eos_median=64)
    assert all(1 <= done <= cap for done, cap in cut.values())
    assert sum(done < cap for done, cap in cut.values()) > len(cut) / 2
    same = completions("consistent-hash", eos_median=64)
    assert same.keys() & cut.keys()
    assert all(same[k] == cut[k] for k in same.keys() & cut.keys())


def test_bad_traffic_options_are_one_line():
    for extra, message in ((["--ramp", "-1"], "--ramp"), (["--eos-median", "0"], "--eos-median"),
                           (["--warm-start-as-driver", "--cold-start"], "--warm-start-as-driver")):
        proc = subprocess.run([sys.executable, "-m", "kvrouter.cli", "simulate", "--replicas", "2",
                               "--duration", "10", *extra], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_warm_start_as_driver_numbers_sessions_in_the_order_they_start():
    # As the load driver does: a session that ends during the ramp hands the next index to its
    # replacement before the users still to start get theirs.
    sim = ClusterSimulator(SimConfig(replicas=2, sessions=8, duration_s=400.0, seed=4, warmup_s=0,
                                     ramp_s=300.0, warm_start_as_driver=True), "round-robin", WL)
    sim.run()
    first: dict[int, tuple[float, int]] = {}
    for r in sim.records:
        idx = int(r.session_id.rsplit("-", 1)[1])
        if idx not in first or r.start_s < first[idx][0]:
            first[idx] = (r.start_s, r.turn_index)
    starts = [first[i][0] for i in sorted(first)]
    assert starts == sorted(starts)  # indices follow start times, replacements interleaved
    grid = {300.0 * u / 8 for u in range(8)}  # the users' ramp times
    replacements = [i for i, (at, _) in first.items() if at < 300.0 and at not in grid]
    assert replacements  # some session did end during the ramp: the case under test
    for i, (at, turn) in first.items():
        # A user's first session at the driver's warm-start turn, a replacement from its start.
        expected = warm_start_batch(make_session(WL, 4, i), 4)[0].turn_index if at in grid else 0
        assert turn == expected, (i, at)
