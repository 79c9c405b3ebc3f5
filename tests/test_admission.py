"""Admission control's pure decision logic (router/admission.py): tickets, the assessment
(dispatch, wait, reject), the fair queue and its pump, on hand-built snapshots and times."""

from __future__ import annotations

import pytest

from kvrouter.policies.cost import CostParams
from kvrouter.policies.domain import Decision, ReplicaView, RequestSummary, Snapshot
from kvrouter.policies.steps import HighWater
from kvrouter.router.admission import (
    Assessor, CompletionMeter, FairQueue, Judgement, Prediction, Ticket, TicketBook, Verdict,
    key_digest, pump,
)
from kvrouter.router.admission_config import AdmissionConfig
from kvrouter.router.config import ConfigError, parse_config

HW = HighWater(max_running=4, max_queue=2, max_token_usage=0.92)


def ticket(tenant: str = "a", rank: int = 1, slo: float | None = None, weight: float = 1.0,
           priority: str = "default") -> Ticket:
    return Ticket(tenant, priority, rank, weight, slo)


# -- tickets --------------------------------------------------------------------------------------
def test_ticket_maps_api_key_to_tenant_class_and_slo_and_header_only_tightens() -> None:
    cfg = AdmissionConfig(ttft_slo_s=10.0, tenants={
        "ci": {"api_key_sha256": [key_digest("sk-ci")], "priority": "batch", "weight": 0.5, "ttft_slo_s": 60.0}})
    book = TicketBook(cfg)
    t = book.ticket("sk-ci", None, None)
    assert (t.tenant, t.priority, t.rank, t.weight, t.ttft_slo_s) == ("ci", "batch", 2, 0.5, 60.0)
    assert book.ticket("sk-ci", "interactive", None).rank == 0  # the request's own class wins
    assert book.ticket("sk-ci", None, "2500").ttft_slo_s == 2.5
    assert book.ticket("sk-ci", None, "900000").ttft_slo_s == 60.0  # a header never loosens it
    other = book.ticket("sk-someone", "nonsense", "abc")
    assert other.tenant.startswith("key-") and "sk-someone" not in other.tenant
    assert (other.priority, other.ttft_slo_s) == ("default", 10.0)
    assert book.ticket(None, None, None).tenant == "anonymous"


def test_config_rejects_unknown_classes_and_bad_digests() -> None:
    with pytest.raises(ConfigError, match="default_class"):
        parse_config({"admission": {"default_class": "gold"}})
    with pytest.raises(ConfigError, match="priority"):
        parse_config({"admission": {"tenants": {"x": {"priority": "gold"}}}})
    with pytest.raises(ConfigError, match="hex"):
        parse_config({"admission": {"tenants": {"x": {"api_key_sha256": ["sk-plain-key"]}}}})
    assert not parse_config({}).admission.active  # off by default
    assert parse_config({"admission": {"classes": {"default": {"rank": 0, "ttft_slo_s": 5}}}}).admission.active


# -- assessment -----------------------------------------------------------------------------------
def assessor(**cfg: object) -> Assessor:
    return Assessor(AdmissionConfig(**cfg), CostParams(), HW)


def test_free_replica_dispatches_and_slo_rejects_with_retry_after() -> None:
    a = assessor(queue=True)
    free = Prediction(dispatch_s=1.0, wait_s=5.0, warm_s=0.1, over_marks=False)
    assert a.assess(ticket(), free, waited_s=0, queue_full=False) == Judgement(Verdict.DISPATCH, 1.0, "free")
    late = a.assess(ticket(slo=0.5), free, waited_s=0, queue_full=False)
    assert late.verdict is Verdict.REJECT and late.retry_after_s == 1
    very_late = a.assess(ticket(slo=0.5), Prediction(300.0, 0, 0, False), waited_s=0, queue_full=False)
    assert very_late.retry_after_s == 30  # capped at retry_after_max_s


def test_over_marks_waits_only_when_waiting_predicts_the_lower_ttft() -> None:
    a = assessor(queue=True)
    warm_soon = Prediction(dispatch_s=8.0, wait_s=1.0, warm_s=0.2, over_marks=True)
    assert a.assess(ticket(), warm_soon, waited_s=0, queue_full=False).verdict is Verdict.WAIT
    cold_better = Prediction(dispatch_s=2.0, wait_s=5.0, warm_s=0.2, over_marks=True)
    j = a.assess(ticket(), cold_better, waited_s=0, queue_full=False)
    assert (j.verdict, j.reason) == (Verdict.DISPATCH, "cold_beats_wait")
    # Bounded: a full queue or a request that waited max_wait_s goes now.
    assert a.assess(ticket(), warm_soon, waited_s=0, queue_full=True).reason == "queue_full"
    assert a.assess(ticket(), warm_soon, waited_s=30.0, queue_full=False).reason == "max_wait"
    # Without the queue nothing ever waits (today's behaviour).
    assert assessor().assess(ticket(), warm_soon, waited_s=0, queue_full=False).verdict is Verdict.DISPATCH
    # Waiting that would already miss the SLO is a 429, not a wait.
    assert a.assess(ticket(slo=1.0), warm_soon, waited_s=0, queue_full=False).verdict is Verdict.REJECT


def test_prediction_uses_cost_model_marks_and_completion_rate() -> None:
    a = assessor(queue=True)
    busy = ReplicaView("r0", num_running_reqs=4, num_queue_reqs=3)
    warm = ReplicaView("r1", num_running_reqs=4, num_queue_reqs=0)
    snap = Snapshot((busy, warm))
    req = RequestSummary("/v1/chat/completions", prompt_tokens=100_000, cached_tokens={"r1": 90_000})
    p = a.predict(snap, req, Decision("r0", "fallback"), ahead=3, rate=2.0)
    assert p.over_marks and p.wait_s == pytest.approx(2.0)  # (3 ahead + itself) / 2 per s
    assert p.warm_s < p.dispatch_s  # 90% of the prompt cached on r1 vs cold behind 3 on r0
    unknown = a.predict(snap, req, Decision("r1", "affinity"), ahead=0, rate=None)
    assert unknown.wait_s == pytest.approx(CostParams().queue_s_per_waiting / 2)


def test_completion_meter_rate_over_window_and_horizon() -> None:
    m = CompletionMeter(window=4, horizon_s=10.0)
    assert m.rate(0.0) is None
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        m.completed(t)
    assert m.rate(5.0) == pytest.approx(4 / 3)  # the last 4, over 3 s
    assert m.rate(100.0) is None  # all older than the horizon


# -- the fair queue ---------------------------------------------------------------------------------
def test_queue_orders_by_priority_then_arrival_for_one_tenant() -> None:
    q: FairQueue[str] = FairQueue(10)
    q.push(ticket(rank=2, priority="batch"), 100, 0.0, "batch-1")
    q.push(ticket(), 100, 1.0, "default-1")
    q.push(ticket(), 100, 2.0, "default-2")
    q.push(ticket(rank=0, priority="interactive"), 100, 3.0, "interactive-1")
    assert [w.item for w in q] == ["interactive-1", "default-1", "default-2", "batch-1"]
    assert q.depth_by_priority() == {"batch": 1, "default": 2, "interactive": 1}


def test_fair_share_by_prompt_tokens_interleaves_a_small_tenant_with_a_burst() -> None:
    q: FairQueue[str] = FairQueue(100)
    for i in range(5):  # a burst of 100k-token requests first
        q.push(ticket("burst"), 100_000, 0.0, f"burst-{i}")
    for i in range(3):  # then a small tenant's 10k-token requests
        q.push(ticket("small"), 10_000, 1.0, f"small-{i}")
    order = [w.item for w in q]
    assert order[:4] == ["burst-0", "small-0", "small-1", "small-2"]  # not behind 400k tokens
    # A weight doubles a tenant's share.
    q2: FairQueue[str] = FairQueue(100)
    for i in range(4):
        q2.push(ticket("x"), 1000, 0.0, f"x{i}")
        q2.push(ticket("y", weight=2.0), 1000, 0.0, f"y{i}")
    assert [w.item for w in q2][:6] == ["x0", "y0", "y1", "x1", "y2", "y3"]


def test_withdrawn_request_gives_its_tenant_its_share_back() -> None:
    q: FairQueue[str] = FairQueue(100)
    q.push(ticket("a"), 1000, 0.0, "a0")
    gone = q.push(ticket("b"), 50_000, 0.0, "b0")
    q.withdraw(gone)
    q.push(ticket("b"), 1000, 0.0, "b1")
    q.push(ticket("a"), 1000, 0.0, "a1")
    assert [w.item for w in q] == ["a0", "b1", "a1"]
    assert not gone.queued and len(q) == 3


def test_pump_dispatches_in_order_keeps_waiters_and_counts_those_ahead() -> None:
    q: FairQueue[str] = FairQueue(10)
    for name in ("w0", "w1", "w2", "w3"):
        q.push(ticket(), 10, 0.0, name)
    seen: list[tuple[str, int]] = []
    verdicts = {"w0": Verdict.WAIT, "w1": Verdict.DISPATCH, "w2": Verdict.REJECT, "w3": Verdict.WAIT}

    def try_one(w, ahead):  # type: ignore[no-untyped-def]
        seen.append((w.item, ahead))
        return Judgement(verdicts[w.item], 1.0, "x", 1)

    out = pump(q, 5.0, max_scan=3, try_one=try_one)
    assert seen == [("w0", 0), ("w1", 1), ("w2", 1)]  # max_scan bounds the work
    assert [(w.item, j.verdict) for w, j in out] == [("w1", Verdict.DISPATCH), ("w2", Verdict.REJECT)]
    assert [w.item for w in q] == ["w0", "w3"]


def test_ttft_calibration_learns_observed_over_predicted_and_scales_predictions() -> None:
    a = assessor(queue=True)
    snap = Snapshot((ReplicaView("r0", num_running_reqs=1),))
    req = RequestSummary("/v1/chat/completions", prompt_tokens=50_000)
    before = a.predict(snap, req, Decision("r0", "affinity"), ahead=0, rate=1.0)
    for _ in range(100):  # replicas answer 10x slower than the nominal cost model says
        a.calibration.observe(before.raw_dispatch_s, 10 * before.raw_dispatch_s)
    after = a.predict(snap, req, Decision("r0", "affinity"), ahead=0, rate=1.0)
    assert after.dispatch_s == pytest.approx(10 * before.dispatch_s, rel=0.01)
    assert after.raw_dispatch_s == pytest.approx(before.raw_dispatch_s)
    assert after.wait_s == before.wait_s  # the queue's wait comes from observed completions
    a.calibration.observe(0.01, 100.0)  # too small a prediction to learn from
    a.calibration.observe(1.0, 1e9)  # clamped
    assert a.calibration.factor <= 100.0
