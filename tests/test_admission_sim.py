"""Admission control in the cluster simulator (loadtest/admission_sim.py): the router's own
queue and SLO logic on the virtual clock, under overload."""

from __future__ import annotations

import json

from kvrouter.loadtest.admission_scenarios import main as scenarios_main
from kvrouter.loadtest.admission_sim import AdmissionSimulator
from kvrouter.loadtest.cluster_config import SimConfig
from kvrouter.loadtest.workload_config import load_workload
from kvrouter.router.admission import Ticket
from kvrouter.router.admission_config import AdmissionConfig

CONFIG = SimConfig(replicas=2, sessions=50, duration_s=60.0, seed=3, warmup_s=0.0, drain_s=120.0)


def run(admission: AdmissionConfig, slo: float | None) -> dict:
    sim = AdmissionSimulator(CONFIG, "coding-agent", load_workload("coding-agent"), admission=admission,
                             ticket_of=lambda sid: Ticket("all", "default", 1, 1.0, slo))
    return sim.run()["admission"]


def test_overloaded_fleet_with_slo_rejects_instead_of_queueing_and_loses_nothing() -> None:
    free = run(AdmissionConfig(), None)
    slo = run(AdmissionConfig(queue=True, ttft_slo_s=5.0), 5.0)
    assert free["rejected_429"] == 0 and free["ttft_p95_s"] > 5.0  # overloaded without admission
    assert slo["rejected_429"] > 0
    assert slo["ttft_p95_s"] < free["ttft_p95_s"]
    for result in (free, slo):  # every request was served or cleanly rejected
        assert result["other_errors"] == 0
        assert result["requests"] == result["completed"] + result["rejected_429"]


def test_scenarios_json_is_deterministic(tmp_path) -> None:
    args = ["--replicas", "2", "--sessions", "8", "--duration", "40", "--burst-sessions", "8",
            "--burst-at", "10"]
    scenarios_main([*args, "--json", str(tmp_path / "a.json")])
    scenarios_main([*args, "--json", str(tmp_path / "b.json")])
    a, b = (json.loads((tmp_path / name).read_text()) for name in ("a.json", "b.json"))
    assert a.pop("command") != b.pop("command")  # only the output path differs
    assert a == b
    assert set(a["fair_share"]) == {"no_admission", "queue_arrival_order", "queue_fair_share"}
