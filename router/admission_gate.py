"""The live driver of admission control (router/admission.py): between a request's session and
its first placement, it dispatches, parks the request in the router's queue, or rejects it (429).

A parked request is re-decided, in queue order, whenever a slot is released (the router knows its
own completions), a replica's signals arrive, or its own bound is reached (`max_wait_s`: then it
is dispatched; its SLO: then it gets 429). A client that disconnects while waiting leaves the
queue at once. Every decision and reservation happens without an await in between, as in
`RoutingEngine.place`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping

from ..metrics.router_metrics import RouterMetrics
from ..policies.cost import CostParams
from ..policies.steps import HighWater
from .admission import (
    Assessor, CompletionMeter, FairQueue, Judgement, Ticket, TicketBook, Verdict, Waiter,
    policy_marks, pump,
)
from .admission_config import AdmissionConfig
from .engine import RoutingEngine
from .placement import Placement, RequestRoute
from .security import bearer_token

log = logging.getLogger("kvrouter.admission")


class AdmissionRejected(Exception):
    """The request would miss its TTFT SLO: answer 429 with `retry_after_s`."""

    def __init__(self, judgement: Judgement, slo_s: float) -> None:
        super().__init__(f"predicted time to first token {judgement.predicted_ttft_s:.1f} s "
                         f"exceeds the request's SLO of {slo_s:.1f} s")
        self.retry_after_s = judgement.retry_after_s


class _Pending:
    """A request going through admission: its route, and once dispatched, its placement."""

    __slots__ = ("route", "placement", "done")

    def __init__(self, route: RequestRoute, done: asyncio.Future[Judgement] | None) -> None:
        self.route = route
        self.placement: Placement | None = None
        self.done = done


class AdmissionGate:
    def __init__(
        self,
        config: AdmissionConfig,
        engine: RoutingEngine,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        cost: CostParams,
        high_water: HighWater,
    ) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.clock = clock
        self.book = TicketBook(config)
        self.assessor = Assessor(config, cost, high_water)
        self._marks_of = engine.policy  # a reload (SIGHUP) may bring a policy with other marks
        self.queue: FairQueue[_Pending] = FairQueue(config.max_queue)
        self.meter = CompletionMeter()
        self._wake_pending = False
        engine.on_release = self._released
        engine.on_first_byte = self.assessor.calibration.observe

    @property
    def active(self) -> bool:
        return self.config.active

    def ticket(self, headers: Mapping[str, str], body: Mapping[str, object]) -> Ticket:
        cfg = self.config
        priority = headers.get(cfg.priority_header)
        if priority is None and cfg.priority_field is not None:
            value = body.get(cfg.priority_field)
            priority = value if isinstance(value, str) else None
        slo = headers.get(cfg.slo_header) if cfg.slo_header else None
        return self.book.ticket(bearer_token(headers), priority, slo)

    # -- wake-ups -----------------------------------------------------------------------------------
    def _released(self, url: str, served: bool) -> None:
        if served:  # a retry or a home move frees a slot but completes nothing
            self.meter.completed(self.clock())
        self.wake()

    def wake(self) -> None:
        """Re-decide the waiting requests soon (once per loop turn however many wake-ups)."""
        if self._wake_pending or not len(self.queue):
            return
        self._wake_pending = True
        asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        self._wake_pending = False
        now = self.clock()
        outcomes = pump(self.queue, now, self.config.max_scan,
                        lambda w, ahead: self._try_waiter(w, ahead, now))
        for waiter, judgement in outcomes:
            self._left(waiter, judgement, now)
        self._gauge()

    def _try_waiter(self, waiter: Waiter[_Pending], ahead: int, now: float) -> Judgement:
        """`_try` for a queued request; one that fails (a bug) fails alone: its request gets the
        error and leaves the queue, and the pump goes on answering the others it dispatched."""
        try:
            return self._try(waiter.item, waiter.ticket, ahead, now - waiter.arrived_at)
        except Exception as err:
            log.exception("admission: re-deciding a waiting request failed")
            done = waiter.item.done
            if done is not None and not done.done():
                done.set_exception(err)
            return Judgement(Verdict.REJECT, 0.0, "error")

    # -- one request ------------------------------------------------------------------------------
    async def place(self, route: RequestRoute, ticket: Ticket) -> Placement | None:
        """The request's first placement (None: no replica can take it), after waiting if
        that predicts the lower TTFT. Raises `AdmissionRejected` for an SLO miss."""
        queue = self.queue
        if not len(queue) or queue.full:  # no contention, or no room: decide now
            pending = _Pending(route, None)
            judgement = self._try(pending, ticket, 0, 0.0, queue_full=queue.full)
            if judgement.verdict is not Verdict.WAIT:
                return self._answer(pending, ticket, judgement)
        done: asyncio.Future[Judgement] = asyncio.get_running_loop().create_future()
        pending = _Pending(route, done)
        now = self.clock()
        waiter = queue.push(ticket, route.summary.prompt_tokens, now, pending)
        reason = "warm_wait" if len(queue) == 1 else "behind_queue"
        self.metrics.admission_decisions.labels(Verdict.WAIT.value, reason).inc()
        try:
            self._pump()  # it may leave at once (nobody ahead of it can go, but it can)
            if not done.done():
                await self._wait(waiter, done)
        except BaseException:
            if done.done() and not done.cancelled() and pending.placement is not None:
                pending.placement.done()  # dispatched as the client left: give the slot back
            elif waiter.queued:
                queue.withdraw(waiter)
                self._observe_wait(ticket, "cancelled", self.clock() - waiter.arrived_at)
                self._gauge()
            raise
        return self._answer(pending, ticket, done.result())

    async def _wait(self, waiter: Waiter[_Pending], done: asyncio.Future[Judgement]) -> None:
        """Until a pump answers, or the request's own bound (max wait, SLO) is reached."""
        slo = waiter.ticket.ttft_slo_s
        bound = min(self.config.max_wait_s, slo if slo is not None else math.inf)
        remaining = waiter.arrived_at + bound - self.clock()
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout=max(remaining, 0.0))
        except TimeoutError:
            if done.done():
                return
            now = self.clock()
            waited = max(now - waiter.arrived_at, bound)  # the bound is reached: no more waiting
            judgement = self._try(waiter.item, waiter.ticket, self.queue.ahead_of(waiter), waited,
                                  queue_full=True)
            if judgement.verdict is Verdict.DISPATCH:
                self.queue.served(waiter)
            else:
                self.queue.withdraw(waiter)
            self._left(waiter, judgement, now)
            self._gauge()

    def _try(self, pending: _Pending, ticket: Ticket, ahead: int, waited_s: float, *,
             queue_full: bool = False) -> Judgement:
        """Ask the policy, assess, and on DISPATCH reserve the slot (no await in between)."""
        route, engine = pending.route, self.engine
        if engine.policy is not self._marks_of:
            self._marks_of = engine.policy
            self.assessor.cost, self.assessor.high_water = policy_marks(engine.policy)
        decision, summary = engine.decide(route.summary, route.session)
        if decision is None:  # no replica at all: the relay answers 503
            return Judgement(Verdict.DISPATCH, 0.0, "no_replica")
        prediction = self.assessor.predict(engine.registry.snapshot(), summary, decision, ahead,
                                           self.meter.rate(self.clock()))
        judgement = self.assessor.assess(ticket, prediction, waited_s=waited_s, queue_full=queue_full,
                                         ahead=ahead)
        if judgement.verdict is Verdict.DISPATCH:
            placement = pending.placement = engine.commit(decision, summary, route.session,
                                                          target=route.target)
            placement.predicted_ttft_s = prediction.raw_dispatch_s
        return judgement

    def _left(self, waiter: Waiter[_Pending], judgement: Judgement, now: float) -> None:
        outcome = "dispatched" if judgement.verdict is Verdict.DISPATCH else "rejected"
        self._observe_wait(waiter.ticket, outcome, now - waiter.arrived_at)
        done = waiter.item.done
        if done is not None and not done.done():
            done.set_result(judgement)

    def _answer(self, pending: _Pending, ticket: Ticket, judgement: Judgement) -> Placement | None:
        m = self.metrics
        m.admission_decisions.labels(judgement.verdict.value, judgement.reason).inc()
        if judgement.verdict is Verdict.REJECT:
            m.admission_rejections.labels(ticket.priority, judgement.reason).inc()
            raise AdmissionRejected(judgement, ticket.ttft_slo_s or 0.0)
        return pending.placement

    def _observe_wait(self, ticket: Ticket, outcome: str, waited_s: float) -> None:
        self.metrics.admission_wait.labels(ticket.priority, outcome).observe(max(0.0, waited_s))

    def _gauge(self) -> None:
        depth = self.queue.depth_by_priority()
        for name in self.config.classes:
            self.metrics.admission_queue_depth.labels(name).set(depth.get(name, 0))
