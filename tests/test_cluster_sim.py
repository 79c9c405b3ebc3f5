"""The cluster simulator: deterministic, drives the real policies, handles scale events."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvrouter.loadtest.cluster_sim import ClusterSimulator, ScaleEvent, SimConfig
from kvrouter.loadtest.report import RESULT_KEYS
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


def _first_turns(policy: str) -> dict[str, tuple[int, int]]:
    """Each of the 8 warm-started sessions' first request in the run: (turn index, prompt
    tokens). Sessions started later, as others end, are left out."""
    sim = ClusterSimulator(SimConfig(replicas=2, sessions=8, duration_s=60.0, seed=4, warmup_s=0), policy, WL)
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
