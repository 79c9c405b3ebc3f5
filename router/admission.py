"""Admission control's decision logic: pure, clock-injected, shared by the live router and the
cluster simulator (which drive it: router/admission_gate.py, loadtest/admission_sim.py).

Three parts:
- `assess`: given the policy's decision and the snapshot it was made on, dispatch now, wait in the
  router's queue, or reject. Waiting is chosen only when the chosen replica is over the policy's
  high-water marks and the predicted TTFT of waiting (the expected wait for a slot, from the
  observed completion rate, plus the warmest replica's prefill) beats dispatching now (the cost
  model's expected TTFT there, queueing included). With an SLO, a request whose best predicted
  TTFT (from its arrival) exceeds it is rejected (429) instead of queueing forever.
- `FairQueue`: the waiting requests, ordered by priority class, then by a start-time fair
  queueing tag over prompt tokens per tenant (so one tenant's burst of huge prompts cannot starve
  the others), then by arrival. A single tenant's requests keep their arrival order.
- `CompletionMeter`: completions per second over a sliding window, for the wait prediction.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..policies.coding_agent import CodingAgent, CodingAgentParams
from ..policies.cost import CostParams, expected_cost, prefill_s
from ..policies.domain import Decision, Policy, RequestSummary, Snapshot
from ..policies.steps import HighWater
from .admission_config import AdmissionConfig

T = TypeVar("T")
ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Ticket:
    """Who is asking, and what they were promised: built once per request."""

    tenant: str
    priority: str
    rank: int
    weight: float = 1.0
    ttft_slo_s: float | None = None


class Verdict(enum.Enum):
    DISPATCH = "dispatch"
    WAIT = "wait"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    predicted_ttft_s: float  # from now, for the option taken (or the best one, for a rejection)
    reason: str  # dispatch: "free", "cold_beats_wait", "max_wait", "queue_full"; wait: "warm_wait"; reject: "slo"
    retry_after_s: int = 0


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class TicketBook:
    """Builds a request's `Ticket` from its API key, priority hint and SLO header."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._by_digest = {d: name for name, t in config.tenants.items() for d in t.api_key_sha256}

    def ticket(self, api_key: str | None, priority: str | None, slo_ms: str | None) -> Ticket:
        cfg = self.config
        tenant_name, tenant = ANONYMOUS, None
        if api_key:
            digest = key_digest(api_key)
            tenant_name = self._by_digest.get(digest) or f"key-{digest[:12]}"  # never the key itself
            tenant = cfg.tenants.get(tenant_name)
        if priority not in cfg.classes:
            priority = (tenant.priority if tenant is not None else None) or cfg.default_class
        cls = cfg.classes[priority]
        slo = cfg.ttft_slo_s
        if cls.ttft_slo_s is not None:
            slo = cls.ttft_slo_s
        if tenant is not None and tenant.ttft_slo_s is not None:
            slo = tenant.ttft_slo_s
        asked = _slo_from_header(slo_ms)
        if asked is not None:
            slo = asked if slo is None else min(slo, asked)
        return Ticket(tenant_name, priority, cls.rank, tenant.weight if tenant is not None else 1.0, slo)


def _slo_from_header(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        return None
    return ms / 1000.0 if math.isfinite(ms) and ms > 0 else None


# -- the wait prediction ---------------------------------------------------------------------------
class CompletionMeter:
    """Requests completed per second over the last `window` completions (clock injected)."""

    def __init__(self, window: int = 64, horizon_s: float = 60.0) -> None:
        self._times: deque[float] = deque(maxlen=window)
        self.horizon_s = horizon_s

    def completed(self, now: float) -> None:
        self._times.append(now)

    def rate(self, now: float) -> float | None:
        """None until two completions in the horizon were seen."""
        times = self._times
        while times and now - times[0] > self.horizon_s:
            times.popleft()
        if len(times) < 2:
            return None
        return len(times) / max(now - times[0], 1e-3)


def warm_prefill_s(params: CostParams, snapshot: Snapshot, request: RequestSummary) -> float:
    """Prefill on the usable replica holding most of the prompt, without queueing: what a
    request that waits for a slot there pays once it gets one."""
    cached = 0
    for rid, tokens in request.cached_tokens.items():
        if tokens > cached and snapshot.usable(rid, request) is not None:
            cached = tokens
    cached = min(cached, request.prompt_tokens)
    return prefill_s(params, request.prompt_tokens - cached, cached)


class TtftCalibration:
    """The ratio of observed to predicted TTFT (an EWMA, clamped), learnt from the router's own
    dispatches: the cost model's constants are a nominal replica's, and under overload its queue
    term (a fixed time per queued request) can be off by an order of magnitude. Predictions are
    scaled by it before they are held against an SLO."""

    def __init__(self, weight: float = 0.1, low: float = 0.02, high: float = 100.0) -> None:
        self.weight, self.low, self.high = weight, low, high
        self.factor = 1.0

    def observe(self, predicted_s: float, observed_s: float) -> None:
        if predicted_s < 0.05 or observed_s < 0:  # too small to say anything about the ratio
            return
        ratio = min(self.high, max(self.low, observed_s / predicted_s))
        self.factor += self.weight * (ratio - self.factor)


def policy_marks(policy: Policy) -> tuple[CostParams, HighWater]:
    """The cost model and high-water marks admission judges by: the coding-agent policy's own,
    or its defaults for policies that have none (they never mark a replica full themselves)."""
    p = policy.params if isinstance(policy, CodingAgent) else CodingAgentParams()
    return p.cost, HighWater(p.replica_max_running, p.replica_max_queue, p.replica_max_token_usage)


@dataclass(frozen=True, slots=True)
class Prediction:
    dispatch_s: float  # TTFT if dispatched now where the policy chose
    wait_s: float  # expected wait in the router's queue for a slot
    warm_s: float  # prefill once a slot frees (on the warmest replica)
    over_marks: bool  # the chosen replica is over the policy's high-water marks
    raw_dispatch_s: float = 0.0  # dispatch_s before calibration (what the outcome is compared with)


class Assessor:
    """Dispatch, wait or reject one request (pure: every time and state is passed in)."""

    def __init__(self, config: AdmissionConfig, cost: CostParams, high_water: HighWater) -> None:
        self.config = config
        self.cost = cost
        self.high_water = high_water
        self.calibration = TtftCalibration()

    def predict(self, snapshot: Snapshot, request: RequestSummary, decision: Decision,
                ahead: int, rate: float | None) -> Prediction:
        view = snapshot.get(decision.replica)
        if view is None:
            return Prediction(0.0, 0.0, 0.0, False)
        factor = self.calibration.factor
        dispatch = factor * expected_cost(self.cost, view, request, is_home=True, placement=False)
        over = self.high_water.overloaded(view)
        healthy = snapshot.healthy_count if snapshot.healthy_count is not None else sum(
            1 for r in snapshot.replicas if r.healthy)
        if rate is None or rate <= 0:  # nothing completed yet: one typical prefill per slot freed
            rate = max(1, healthy) / self.cost.queue_s_per_waiting
        warm = factor * warm_prefill_s(self.cost, snapshot, request)
        return Prediction(dispatch, (ahead + 1) / rate, warm, over, dispatch / factor)

    def assess(self, ticket: Ticket, p: Prediction, *, waited_s: float, queue_full: bool,
               ahead: int = 0) -> Judgement:
        """`waited_s`: time already spent in the queue (it counts against the SLO); `ahead`:
        requests before it in the queue still waiting. Only the queue's head may go cold to a
        replica over its marks: the others keep their turn (priority, fair share) unless only a
        cold dispatch now still meets their SLO. A replica under its marks takes anyone."""
        slo = ticket.ttft_slo_s
        if self.config.queue and p.over_marks and not queue_full and waited_s < self.config.max_wait_s:
            waiting = p.wait_s + p.warm_s
            if ahead > 0 or waiting < p.dispatch_s:
                if slo is None or waited_s + waiting <= slo:
                    return Judgement(Verdict.WAIT, waiting, "warm_wait" if ahead == 0 else "behind")
                if waited_s + p.dispatch_s > slo:
                    return self._reject(min(p.dispatch_s, waiting), waited_s, slo)
                reason = "slo_cold"
            else:
                reason = "cold_beats_wait"
        elif p.over_marks:
            reason = "max_wait" if waited_s >= self.config.max_wait_s else (
                "queue_full" if queue_full else "over_marks")
        else:
            reason = "free"
        if slo is not None and waited_s + p.dispatch_s > slo:
            return self._reject(p.dispatch_s, waited_s, slo)
        return Judgement(Verdict.DISPATCH, p.dispatch_s, reason)

    def _reject(self, predicted: float, waited_s: float, slo: float) -> Judgement:
        # Retry when the backlog that made it late has had time to drain.
        late = max(0.0, waited_s + predicted - slo)
        retry = min(self.config.retry_after_max_s, max(1, math.ceil(late)))
        return Judgement(Verdict.REJECT, predicted, "slo", retry)


# -- the queue -----------------------------------------------------------------------------------
@dataclass(slots=True)
class Waiter(Generic[T]):
    """One waiting request; `item` is the driver's (a future, a simulated request)."""

    ticket: Ticket
    prompt_tokens: int
    arrived_at: float
    seq: int
    start_tag: float
    finish_tag: float
    item: T
    queued: bool = field(default=True)

    def order(self) -> tuple[int, float, int]:
        return (self.ticket.rank, self.start_tag, self.seq)


class FairQueue(Generic[T]):
    """Waiting requests in the order they leave: priority rank, then start-time fair queueing
    over prompt tokens per tenant (a request's tag starts at the later of the virtual time and
    its tenant's previous finish tag and lasts prompt_tokens / weight), then arrival."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self._waiting: dict[int, Waiter[T]] = {}
        self._finish: dict[str, float] = {}  # tenant -> finish tag of its last queued request
        self._vtime = 0.0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def full(self) -> bool:
        return len(self._waiting) >= self.max_len

    def push(self, ticket: Ticket, prompt_tokens: int, now: float, item: T) -> Waiter[T]:
        start = max(self._vtime, self._finish.get(ticket.tenant, 0.0))
        finish = start + max(1, prompt_tokens) / ticket.weight
        self._finish[ticket.tenant] = finish
        waiter = Waiter(ticket, prompt_tokens, now, next(self._seq), start, finish, item)
        self._waiting[waiter.seq] = waiter
        return waiter

    def ordered(self) -> list[Waiter[T]]:
        return sorted(self._waiting.values(), key=Waiter.order)

    def ahead_of(self, waiter: Waiter[T]) -> int:
        key = waiter.order()
        return sum(1 for w in self._waiting.values() if w.order() < key)

    def depth_by_priority(self) -> Mapping[str, int]:
        depth: dict[str, int] = {}
        for w in self._waiting.values():
            depth[w.ticket.priority] = depth.get(w.ticket.priority, 0) + 1
        return depth

    def served(self, waiter: Waiter[T]) -> None:
        """`waiter` leaves for a replica: virtual time advances to its start tag."""
        if self._waiting.pop(waiter.seq, None) is not None:
            waiter.queued = False
            self._vtime = max(self._vtime, waiter.start_tag)
            if not self._waiting:  # contention is over: no tenant carries a debt into the next
                self._finish.clear()

    def withdraw(self, waiter: Waiter[T]) -> None:
        """`waiter` leaves unserved (rejected, disconnected): its tenant gets its share back if
        nothing was queued after it."""
        if self._waiting.pop(waiter.seq, None) is None:
            return
        waiter.queued = False
        tenant = waiter.ticket.tenant
        if self._finish.get(tenant) == waiter.finish_tag:
            self._finish[tenant] = waiter.start_tag
        if not self._waiting:  # idle: nobody's history matters any more
            self._finish.clear()

    def __iter__(self) -> Iterator[Waiter[T]]:
        return iter(self.ordered())


Outcome = tuple[Waiter[T], Judgement]


def pump(queue: FairQueue[T], now: float, max_scan: int,
         try_one: Callable[[Waiter[T], int], Judgement]) -> list[Outcome[T]]:
    """Re-decide up to `max_scan` waiting requests in queue order. `try_one(waiter, ahead)` asks
    the policy again and assesses it (dispatching commits the placement: the next one sees it).
    Dispatched waiters are `served`, rejected ones `withdrawn`; both are returned with their
    judgement so the driver can answer them. A waiter that must keep waiting stays."""
    out: list[Outcome[T]] = []
    ahead = 0
    for waiter in queue.ordered()[:max_scan]:
        judgement = try_one(waiter, ahead)
        if judgement.verdict is Verdict.DISPATCH:
            queue.served(waiter)
        elif judgement.verdict is Verdict.REJECT:
            queue.withdraw(waiter)
        else:
            ahead += 1
            continue
        out.append((waiter, judgement))
    return out
