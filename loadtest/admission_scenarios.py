"""Admission control measured in the cluster simulator (docs/admission.md):

    python -m kvrouter.loadtest.admission_scenarios --json docs/admission/sim.json

- `overload`: a 4-replica fleet given more coding-agent sessions than it can serve, without
  admission control, then with the router's queue and a TTFT SLO: TTFT of the admitted requests,
  429s, and requests lost (neither served nor rejected).
- `fair_share`: the same fleet shared by two tenants, one with 3x the sessions of the other
  (so 3x the prompt tokens): the router's queue in arrival order, then with fair share by prompt
  tokens. Same seeded traffic in every run; the same seed gives byte-identical JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..router.admission import Ticket
from ..router.admission_config import AdmissionConfig
from .admission_sim import AdmissionSimulator
from .cluster_config import SimConfig
from .workload import Session, make_session
from .workload_config import load_workload


def session_index(session_id: str) -> int:
    return int(session_id.rsplit("-", 1)[1])


def one_tenant(session_id: str) -> Ticket:
    return Ticket("all", "default", 1)


STEADY_SESSIONS = 16  # sessions 0-15: the steady tenant's; the rest arrive in one burst


def two_tenants(session_id: str) -> Ticket:
    name = "steady" if session_index(session_id) < STEADY_SESSIONS else "burst"
    return Ticket(name, "default", 1)


def burst_arrivals(config: SimConfig, burst_sessions: int, burst_at_s: float) -> list[tuple[float, Session]]:
    """The steady tenant's sessions start over the first 10 s; the other tenant's
    `burst_sessions` all within one second at `burst_at_s` (a batch job landing)."""
    workload = load_workload("coding-agent")
    steady = [(10.0 * i / STEADY_SESSIONS, make_session(workload, config.seed, i))
              for i in range(STEADY_SESSIONS)]
    burst = [(burst_at_s + i / burst_sessions, make_session(workload, config.seed, STEADY_SESSIONS + i))
             for i in range(burst_sessions)]
    return steady + burst


def tenant_label(fair: bool) -> Callable[[str], Ticket]:
    """Fair share off: the queue sees one tenant (arrival order); results still split by tenant."""
    def ticket_of(session_id: str) -> Ticket:
        t = two_tenants(session_id)
        return t if fair else Ticket("all", t.priority, t.rank)
    return ticket_of


def run(config: SimConfig, admission: AdmissionConfig, ticket_of: Any, split: Any,
        arrivals: list[tuple[float, Session]] | None = None) -> dict[str, Any]:
    def with_slo(session_id: str) -> Ticket:  # what TicketBook does with the global SLO
        return dataclasses.replace(ticket_of(session_id), ttft_slo_s=admission.ttft_slo_s)

    sim = AdmissionSimulator(config, "coding-agent", load_workload("coding-agent"),
                             admission=admission, ticket_of=with_slo, arrivals=arrivals)
    result = sim.run()
    summary = result["admission"]
    if split is not None:  # per-tenant figures by the real tenant even when the queue saw one
        sim.ticket_of = split
        summary = sim.admission_summary()
    return {
        "admission": admission.model_dump(exclude={"classes", "tenants"}),
        "cache_hit_rate": result.get("cache_hit_rate"),
        "decisions": result["decisions"],
        **summary,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=120)
    ap.add_argument("--duration", type=float, default=240.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo", type=float, default=10.0, help="TTFT SLO (s) of the overload run")
    ap.add_argument("--fair-max-running", type=int, default=4,
                    help="the policy's replica_max_running in the fair-share runs: the marks that "
                    "make the router, not the replicas' own FCFS queues, hold the backlog")
    ap.add_argument("--burst-sessions", type=int, default=200)
    ap.add_argument("--burst-at", type=float, default=60.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    config = SimConfig(replicas=args.replicas, sessions=args.sessions, duration_s=args.duration,
                       seed=args.seed, warmup_s=60.0, drain_s=300.0)
    given = sys.argv[1:] if argv is None else argv
    out: dict[str, Any] = {"command": " ".join(["python -m kvrouter.loadtest.admission_scenarios", *given]),
                           "replicas": args.replicas, "sessions": args.sessions,
        "duration_s": args.duration, "seed": args.seed}
    out["overload"] = {
        "no_admission": run(config, AdmissionConfig(), one_tenant, None),
        "queue_only": run(config, AdmissionConfig(queue=True), one_tenant, None),
        f"queue_slo_{args.slo:g}s": run(config, AdmissionConfig(queue=True, ttft_slo_s=args.slo),
                                        one_tenant, None),
    }
    fair = dataclasses.replace(config, policy_params={"replica_max_running": args.fair_max_running},
                               warmup_s=args.burst_at, warm_start=False)
    def arrivals() -> list[tuple[float, Session]]:  # sessions are stateful: fresh ones per run
        return burst_arrivals(fair, args.burst_sessions, args.burst_at)

    out["fair_share"] = {
        "no_admission": run(fair, AdmissionConfig(), tenant_label(False), two_tenants, arrivals()),
        "queue_arrival_order": run(fair, AdmissionConfig(queue=True), tenant_label(False), two_tenants,
                                   arrivals()),
        "queue_fair_share": run(fair, AdmissionConfig(queue=True), tenant_label(True), two_tenants,
                                arrivals()),
    }
    text = json.dumps(out, indent=1, sort_keys=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
