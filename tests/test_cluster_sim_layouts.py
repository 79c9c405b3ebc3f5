"""The cluster simulator's layouts. Prefill/decode: the policy places on prefill servers, the live
router's decode pick on decode servers, each request runs prefill -> KV transfer -> decode. DP
attention: the policy picks the replica from folded signals, the live rank table the rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvrouter.loadtest.cluster_sim import ClusterSimulator, SimConfig
from kvrouter.loadtest.cluster_sim_pd import PDClusterSimulator, decode_name, split_fleet
from kvrouter.loadtest.report import RESULT_KEYS
from kvrouter.loadtest.sim_disagg import Disaggregation
from kvrouter.loadtest.workload_config import load_workload

WL = load_workload("coding-agent")
CONFIG = SimConfig(replicas=6, sessions=24, duration_s=240.0, seed=3)


@pytest.fixture(scope="module")
def pd_run() -> tuple[PDClusterSimulator, dict]:
    sim = PDClusterSimulator(CONFIG, "coding-agent", WL)
    return sim, sim.run()


def test_split_fleet():
    assert split_fleet(6) == (3, 3) and split_fleet(5) == (3, 2) and split_fleet(8, 2) == (6, 2)
    for servers, decode in ((1, None), (4, 0), (4, 4)):
        with pytest.raises(ValueError, match="decode servers"):
            split_fleet(servers, decode)


def test_the_policy_routes_prefill_and_decode_pick_the_decode_servers(pd_run):
    sim, result = pd_run
    assert all(key in result for key in RESULT_KEYS)
    assert result["requests_ok"] > 20 and result["requests_failed"] == 0
    assert (result["prefill_servers"], result["decode_servers"]) == (3, 3)
    # every request had both a policy decision (prefill) and a decode pick
    assert result["decisions"]["decode_least_load"] >= result["requests_ok"]
    assert sum(v for k, v in result["decisions"].items() if k != "decode_least_load") \
        == result["decisions"]["decode_least_load"]
    prefill = {r.replica for r in sim.records}
    assert prefill <= {"replica-0000", "replica-0001", "replica-0002"}
    # the decode servers ran the output, the prefill servers one token per request
    decode_models = [sim.models[decode_name(i)] for i in range(3)]
    assert all(m.num_requests_total > 0 for m in decode_models)
    ok = [r for r in sim.records if r.ok]
    out_tokens = sum(m.generation_tokens_total for m in decode_models)
    assert out_tokens >= sum(r.completion_tokens for r in ok)
    prefill_models = [sim.models[url] for url in ("replica-0000", "replica-0001", "replica-0002")]
    assert sum(m.generation_tokens_total for m in prefill_models) == sum(m.num_requests_total for m in prefill_models)
    # the sessions' prefixes are reused on the prefill servers (affinity), and the KV moved
    assert result["cache_hit_rate"] > 0.5 and result["kv_transfer_s_total"] > 0
    assert sim.decode_registry.snapshot().replicas and all(
        v.in_flight == 0 for v in sim.decode_registry.snapshot().replicas)  # every slot released


def test_the_kv_transfer_is_on_the_ttft():
    slow = PDClusterSimulator(CONFIG, "coding-agent", WL, disaggregation=Disaggregation("decode", transfer_gbps=0.5))
    fast = PDClusterSimulator(CONFIG, "coding-agent", WL, disaggregation=Disaggregation("decode", transfer_gbps=5000))
    slow_r, fast_r = slow.run(), fast.run()
    # at 0.5 GB/s a 50k-token prompt's KV (~70 KB per token) takes seconds, not milliseconds
    assert slow_r["ttft_p50_s"] > fast_r["ttft_p50_s"] + 1.0


def test_colocated_is_untouched_and_pd_is_deterministic(tmp_path: Path):
    base = ClusterSimulator(SimConfig(replicas=4, sessions=8, duration_s=120.0, seed=2), "coding-agent", WL)
    assert "layout" not in base.run()
    outs = []
    for name in ("a.json", "b.json"):
        path = tmp_path / name
        subprocess.run([sys.executable, "-m", "kvrouter.cli", "simulate", "--replicas", "4",
                        "--sessions", "8", "--duration", "120", "--seed", "2", "--layout", "pd",
                        "--json", str(path)], check=True, capture_output=True, timeout=120)
        outs.append(path.read_bytes())
    assert outs[0] == outs[1]
    report = json.loads(outs[0])
    assert report["workload"]["layout"] == "pd" and report["workload"]["decode_servers"] == 2


def test_bad_layout_arguments_are_one_line():
    for extra, message in ((["--scale", "60:+1"], "not modelled"), (["--decode-servers", "4"], "decode servers")):
        proc = subprocess.run([sys.executable, "-m", "kvrouter.cli", "simulate", "--replicas", "4",
                               "--duration", "10", "--layout", "pd", *extra],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


# -- DP attention ----------------------------------------------------------------------------------
def test_dp_layout_routes_ranks_with_the_live_rank_table():
    from kvrouter.loadtest.cluster_sim_dp import DPClusterSimulator, fold_ranks
    from kvrouter.loadtest.profiles import load_profile
    from kvrouter.sglang_protocol.signals import ReplicaSignals

    profile = "kimi-k2.6-b200-tp4-dp4-fp8kv"
    sim = DPClusterSimulator(SimConfig(replicas=3, sessions=24, duration_s=240.0, seed=3, profile=profile),
                             "coding-agent", WL, dp_size=4)
    result = sim.run()
    assert result["requests_ok"] > 20 and result["requests_failed"] == 0
    assert result["layout"] == "dp" and sim.engine.ranks is not None
    assert len(sim.models) == 12 and sorted(sim.registry.urls()) == ["replica-0000", "replica-0001", "replica-0002"]
    # the router knows each replica's ranks folded together: four ranks' KV pools
    per_rank = load_profile(profile).max_total_num_tokens
    assert all(v.max_total_num_tokens == 4 * per_rank for v in sim.registry.snapshot().replicas)
    # requests went to several ranks of a replica, and the rank's model ran them
    served = {url: m.num_requests_total for url, m in sim.models.items()}
    assert sum(served.values()) >= result["requests_ok"]
    assert max(sum(1 for r in range(4) if served[f"{u}#dp{r}"] > 0) for u in sim.registry.urls()) >= 2
    assert result["cache_hit_rate"] > 0.5
    folded = fold_ranks({0: ReplicaSignals(num_running_reqs=2, token_usage=0.5),
                         1: ReplicaSignals(num_running_reqs=3, token_usage=0.7)})
    assert folded.num_running_reqs == 5 and folded.token_usage == 0.7


def test_dp_layout_cli_and_its_arguments(tmp_path: Path):
    path = tmp_path / "dp.json"
    subprocess.run([sys.executable, "-m", "kvrouter.cli", "simulate", "--replicas", "2", "--sessions", "6",
                    "--duration", "90", "--seed", "2", "--layout", "dp", "--dp-size", "4",
                    "--profile", "kimi-k2.6-b200-tp4-dp4-fp8kv", "--json", str(path)],
                   check=True, capture_output=True, timeout=120)
    workload = json.loads(path.read_bytes())["workload"]
    assert workload["layout"] == "dp" and workload["dp_size"] == 4
    for argv, message in ((["--layout", "dp"], "--dp-size 2 or more"), (["--dp-size", "4"], "needs --layout dp"),
                          (["--layout", "dp", "--dp-size", "4", "--scale", "60:+1"], "not modelled")):
        proc = subprocess.run([sys.executable, "-m", "kvrouter.cli", "simulate", "--replicas", "4",
                               "--duration", "10", *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
