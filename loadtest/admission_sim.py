"""The cluster simulator with the router's admission control in front of its routing engine.

`AdmissionSimulator` drives the very objects the live gate (router/admission_gate.py) drives:
`Assessor` (dispatch, wait or reject), `FairQueue` (priority, fair share, arrival) and
`CompletionMeter`, on the simulator's virtual clock. A waiting request is re-decided after every
replica event that completed a request and at every signal poll (where waiters past their bound
are dispatched, or rejected past their SLO: a 0.25 s resolution, the poll interval).
A rejected request is recorded with error "HTTP 429"; the turn goes on as after any error.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from ..policies.domain import SessionView
from ..router.admission import (
    Assessor, CompletionMeter, FairQueue, Judgement, Ticket, Verdict, Waiter, policy_marks, pump,
)
from ..router.admission_config import AdmissionConfig
from ..router.placement import Placement
from .cluster_config import SimConfig
from .cluster_sim import ClusterSimulator, _Pending
from .report import RequestRecord, percentile
from .turn_request import TurnRequest
from .workload_config import WorkloadConfig

REJECTED = "HTTP 429"
TicketOf = Callable[[str], Ticket]  # session id -> the ticket its requests carry


class _Parked:
    __slots__ = ("pending", "placement")

    def __init__(self, pending: _Pending) -> None:
        self.pending = pending
        self.placement: Placement | None = None


class AdmissionSimulator(ClusterSimulator):
    def __init__(self, config: SimConfig, policy: str, workload: WorkloadConfig, *,
                 admission: AdmissionConfig, ticket_of: TicketOf, **kwargs: Any) -> None:
        super().__init__(config, policy, workload, **kwargs)
        self.admission = admission
        self.ticket_of = ticket_of
        self.assessor = Assessor(admission, *policy_marks(self.engine.policy))
        self.queue: FairQueue[_Parked] = FairQueue(admission.max_queue)
        self.meter = CompletionMeter()
        self.waits: list[float] = []
        self.judgements: Counter[str] = Counter()  # "verdict:reason" of every assessment made
        self.max_depth = 0
        self._pump_due = False
        self._predicted: dict[int, tuple[float, float]] = {}  # placement -> (sent at, raw prediction)

    # -- arrivals -----------------------------------------------------------------------------------
    def _dispatch(self, idx: int, req: TurnRequest) -> None:
        if not self.admission.active:
            super()._dispatch(idx, req)
            return
        parked = _Parked(self._prepare(idx, req))
        ticket = self.ticket_of(req.session_id)
        queue = self.queue
        if not len(queue) or queue.full:
            judgement = self._try(parked, ticket, 0, 0.0, queue_full=queue.full)
            if judgement.verdict is not Verdict.WAIT:
                self._answer(parked, judgement)
                return
        queue.push(ticket, req.prompt_tokens, self.now, parked)
        self.max_depth = max(self.max_depth, len(queue))
        self._pump()

    def _try(self, parked: _Parked, ticket: Ticket, ahead: int, waited_s: float, *,
             queue_full: bool = False) -> Judgement:
        pending = parked.pending
        decision, summary = self.engine.decide(pending.summary, pending.view)
        if decision is None:
            return Judgement(Verdict.DISPATCH, 0.0, "no_replica")
        prediction = self.assessor.predict(self.registry.snapshot(), summary, decision, ahead,
                                           self.meter.rate(self.now))
        judgement = self.assessor.assess(ticket, prediction, waited_s=waited_s, queue_full=queue_full,
                                         ahead=ahead)
        self.judgements[f"{judgement.verdict.value}:{judgement.reason}"] += 1
        if judgement.verdict is Verdict.DISPATCH:
            placement = parked.placement = self.engine.commit(decision, summary, pending.view)
            self._predicted[id(placement)] = (self.now, prediction.raw_dispatch_s)
        return judgement

    def _answer(self, parked: _Parked, judgement: Judgement) -> None:
        pending = parked.pending
        if judgement.verdict is Verdict.REJECT:
            self._start(pending, None, error=f"{REJECTED}: predicted TTFT over SLO")
            return
        view: SessionView = pending.view
        placement = parked.placement
        self._start(pending, None if placement is None else self._place(pending.summary, view, placement))

    def _left(self, waiter: Waiter[_Parked], judgement: Judgement) -> None:
        self.waits.append(self.now - waiter.arrived_at)
        self._answer(waiter.item, judgement)

    # -- wake-ups -----------------------------------------------------------------------------------
    def _pump(self) -> None:
        now = self.now
        for waiter, judgement in pump(self.queue, now, self.admission.max_scan,
                                      lambda w, ahead: self._try(w.item, w.ticket, ahead, now - w.arrived_at)):
            self._left(waiter, judgement)

    def _expire(self) -> None:
        """Waiters past their bound (max wait, or SLO) leave now: dispatched or rejected."""
        cfg = self.admission
        for waiter in self.queue.ordered():
            slo = waiter.ticket.ttft_slo_s
            bound = min(cfg.max_wait_s, slo if slo is not None else cfg.max_wait_s)
            if self.now - waiter.arrived_at < bound:
                continue
            judgement = self._try(waiter.item, waiter.ticket, 0, max(bound, self.now - waiter.arrived_at),
                                  queue_full=True)
            if judgement.verdict is Verdict.DISPATCH:
                self.queue.served(waiter)
            else:
                self.queue.withdraw(waiter)
            self._left(waiter, judgement)

    def _finish(self, rid: str, flight: Any, *, ok: bool, completion: int = 0, cached: int = 0) -> None:
        sent = self._predicted.pop(id(flight.placement), None)
        if sent is not None and ok and flight.first is not None:  # the live relay's first byte
            self.assessor.calibration.observe(sent[1], flight.first - sent[0])
        super()._finish(rid, flight, ok=ok, completion=completion, cached=cached)
        self.meter.completed(self.now)
        self._pump_due = True  # after the replica's events are handled (see _advance)

    def _advance(self, url: str) -> None:
        super()._advance(url)
        if self._pump_due:
            self._pump_due = False
            if len(self.queue):
                self._pump()

    def _poll(self) -> None:
        super()._poll()
        if len(self.queue):
            self._expire()
            self._pump()

    def _run(self) -> dict[str, Any]:
        out = super()._run()
        while len(self.queue):  # the run ended with requests waiting: none is lost silently
            waiter = self.queue.ordered()[0]
            self.queue.withdraw(waiter)
            waiter.item.pending.record.error = "still waiting at end of drain"
            self.records.append(waiter.item.pending.record)
        out["admission"] = self.admission_summary()
        return out

    # -- results ----------------------------------------------------------------------------------
    def admission_summary(self) -> dict[str, Any]:
        cfg = self.config
        measured = [r for r in self.records if cfg.warmup_s <= r.start_s < cfg.duration_s]
        out = _outcomes(measured)
        out["queue_wait_p95_s"] = _round(percentile(self.waits, 95))
        out["queue_max_depth"] = self.max_depth
        out["assessments"] = dict(sorted(self.judgements.items()))
        out["ttft_calibration"] = round(self.assessor.calibration.factor, 3)
        tenants: dict[str, list[RequestRecord]] = {}
        for r in measured:
            tenants.setdefault(self.ticket_of(r.session_id).tenant, []).append(r)
        out["tenants"] = {name: _outcomes(rs) for name, rs in sorted(tenants.items())}
        return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _outcomes(records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    rejected = [r for r in records if not r.ok and (r.error or "").startswith(REJECTED)]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "requests": len(records),
        "completed": len(ok),
        "rejected_429": len(rejected),
        "other_errors": len(records) - len(ok) - len(rejected),
        "ttft_p50_s": _round(percentile(ttft, 50)),
        "ttft_p95_s": _round(percentile(ttft, 95)),
        "prompt_tokens_served": sum(r.prompt_tokens for r in ok),
    }
