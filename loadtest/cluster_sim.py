"""Deterministic discrete-event cluster simulator: the real policies against the real replica model.

One heap of timed events and a virtual clock; no asyncio, no sleeps, no wall clock. Each replica is
a `ReplicaModel`; routing goes through the live router's own `RoutingEngine` (same policy objects,
same shadow KV index, same session table as the in-memory affinity store), fed with replica
signals polled every `poll_interval_s` as the live router polls `/metrics`. Each request takes the
live router's own routing lifecycle (`RoutingEngine.place`, then the `Placement`'s home, outcome
(`answered`: simulated replicas are always reachable), acceptance and release; router/placement.py) against the synchronous in-memory affinity store. Sessions come from the
coding-agent workload (closed loop: each turn waits for every request of the previous one plus a
think time) or from a trace (see loadtest/traces.py).

Event kinds, in order of priority at equal times: scale events, replica wake-ups (the model's next
internal event), signal polls, delayed signal deliveries, housekeeping (session expiry, fresh
settling, rebalancing), load samples, requests.

The router side knows only what the live router knows: signals (and KV capacity) arrive only by
polls; an ended session keeps its home until `session_ttl_s` of idleness (`SessionTable.expire`);
a crashed replica is found out by failed polls and refused connects. The fleet's true speed, KV
and signal lag may differ from the profile the policy assumes (`SimConfig.world`, world.py).

Configuration and scale events: cluster_config.py; load samples and the result: cluster_sampling.py.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..sglang_protocol.signals import ReplicaSignals
from ..policies.domain import RequestSummary, SessionView
from ..policies.registry import build_policy
from ..router.affinity import LocalAffinity
from ..router.engine import RoutingEngine
from ..router.kv_index_shadow import ShadowKVIndex
from ..router.placement import Placement
from ..router.replicas import ReplicaRegistry
from ..router.sessions import SessionTable
from .cluster_config import ScaleEvent, SimConfig
from .cluster_sampling import SamplingMixin
from .profiles import Profile, load_profile, scale_profile
from .replica_model import Finished, FirstToken, ReplicaModel, RequestTooLarge, SimRequest
from .report import RequestRecord
from .segment_keys import SegmentKeyCache
from .sim_replica import eos_length
from .turn_request import TurnRequest
from .workload import Session, fast_forward, make_session, warm_start_batch
from .workload_config import WorkloadConfig
from .world import SignalDelay

ROUTE = "/v1/chat/completions"
_SCALE, _WAKE, _POLL, _SIGNAL, _HOUSE, _SAMPLE, _ARRIVE, _REQUEST = range(8)
_USER = 8  # a closed-loop user's first session, at its ramp time (`warm_start_as_driver`)


@dataclass(slots=True)
class _Flight:
    req: TurnRequest
    session_idx: int
    replica: str
    placement: Placement
    start: float
    record: RequestRecord
    first: float | None = None


@dataclass(slots=True)
class _Pending:
    """A request between its arrival at the router and its dispatch."""

    idx: int
    req: TurnRequest
    summary: RequestSummary
    view: SessionView
    keys: list[int]
    record: RequestRecord


@dataclass(slots=True)
class _Turn:
    batch: list[TurnRequest]
    replies: list[int | None]
    pending: int


def replica_name(i: int) -> str:
    return f"replica-{i:04d}"


def signals_of(model: ReplicaModel, now: float) -> ReplicaSignals:
    """What the router's poller would parse from the replica's /metrics at `now`: the gauges as
    SGLang last refreshed them (after a prefill batch, every decode_log_interval decode steps,
    or idle), never the instant state."""
    m = model.published_metrics(now)
    return ReplicaSignals(
        num_running_reqs=m.num_running_reqs,
        num_queue_reqs=m.num_queue_reqs,
        token_usage=m.token_usage,
        num_used_tokens=m.num_used_tokens,
        max_total_num_tokens=model.profile.max_total_num_tokens,
        cache_hit_rate=m.cache_hit_rate,
        gen_throughput=m.gen_throughput,
        kv_available_tokens=m.kv_available_tokens,
        kv_evictable_tokens=m.kv_evictable_tokens,
    )


class ClusterSimulator(SamplingMixin):
    def __init__(
        self,
        config: SimConfig,
        policy: str,
        workload: WorkloadConfig,
        *,
        profile: Profile | None = None,
        session_factory: Callable[[int], Session] | None = None,
        arrivals: Iterable[tuple[float, Session]] | None = None,
    ) -> None:
        """`session_factory(i)` makes closed-loop session i (the workload's by default).
        `arrivals` replaces that population with sessions starting at given times (trace replay,
        open loop across sessions); ended sessions are then not replaced."""
        self.config = config
        self.policy_name = policy
        self.workload = workload
        nominal = profile or load_profile(config.profile)
        if config.page_tokens is not None and config.page_tokens != nominal.page_size:
            nominal = nominal.model_copy(update={"page_size": config.page_tokens})
        # The router is configured for the nominal profile; the replicas run the true one.
        self.nominal_profile = nominal
        world = config.world
        self.profile = scale_profile(nominal, speed=world.speed, capacity=world.capacity)
        self.stride = max(1, config.index_block_tokens // self.profile.page_size)
        # The traffic's own draws (warm-start turns, unless drawn as the load driver draws them)
        # come from the seed alone: every policy is measured on the same sessions, whatever its name.
        self.rng = random.Random(f"sim:{config.seed}")
        self.registry = ReplicaRegistry(failure_threshold=config.failure_threshold)
        self.table = SessionTable(ttl_s=config.session_ttl_s)
        self.affinity = LocalAffinity(self.table, clock=lambda: self.now)  # the live default store
        self.index = ShadowKVIndex(self.profile.page_size * self.stride, nominal.max_total_num_tokens)
        self._dirty: set[str] = set()  # replicas whose state changed since the last poll
        self.signal_delay = SignalDelay(world.signal_lag_s) if world.signal_lag_s > 0 else None
        self._idle_refresh: dict[str, float] = {}  # idle replicas -> their gauges' idle refresh
        self.engine = RoutingEngine(
            build_policy(policy, config.policy_params), self.registry, self.index, self.table,
            random.Random(f"policy:{config.seed}"),
            default_capacity_tokens=nominal.max_total_num_tokens,
        )
        self.models: dict[str, ReplicaModel] = {}
        self.keys = SegmentKeyCache(self.profile.page_size, namespace="sim-model")
        self.make_session = session_factory or (lambda i: make_session(workload, config.seed, i))
        self.arrivals = arrivals
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._wake_at: dict[str, float] = {}
        self._dead: set[str] = set()  # crashed replicas the router still lists
        self._signal_due_at = -math.inf  # the last delivery event scheduled
        self._flights: dict[str, _Flight] = {}
        self._turns: dict[int, _Turn] = {}
        self._sessions: dict[int, Session] = {}
        self._next_session = 0
        self._rid = itertools.count()
        self.records: list[RequestRecord] = []
        self.load_samples: list[list[float]] = []
        self.load_timeline: list[dict[str, float]] = []
        self.session_timeline: list[dict[str, float]] = []
        self.decisions: Counter[str] = Counter()
        self.events = 0
        self.rebalanced = 0
        self._last_rebalance = 0.0
        for i in range(config.replicas):
            self._add_replica(replica_name(i), fresh=False)
        self._replica_counter = config.replicas

    # -- event plumbing --------------------------------------------------------------------------
    def _push(self, at: float, kind: int, payload: Any = None) -> None:
        heapq.heappush(self._heap, (at, kind, next(self._seq), payload))

    def _wake(self, url: str) -> None:
        model = self.models.get(url)
        if model is None:
            return
        at = model.next_event_time()
        if at is None:
            return
        at = max(at, self.now)
        if self._wake_at.get(url, math.inf) > at:
            self._wake_at[url] = at
            self._push(at, _WAKE, url)

    # -- replicas ----------------------------------------------------------------------------------
    def _add_replica(self, url: str, *, fresh: bool) -> None:
        # The router polls /metrics only (signals_of): no /v1/loads snapshot to keep.
        self.models[url] = ReplicaModel(self.profile, publish_loads=False)
        self.engine.add_replica(url, self.now, fresh=fresh)
        self._dirty.add(url)  # the router hears of its signals (and capacity) at the next poll

    def _kill_replica(self, url: str) -> None:
        """The replica crashes. Nothing tells the router: it stays in the registry until failed
        polls and refused connects (`failure_threshold` in a row) mark it unhealthy."""
        if self.models.pop(url, None) is None:
            return
        self._dead.add(url)
        self._wake_at.pop(url, None)
        for rid, flight in list(self._flights.items()):
            if flight.replica == url:  # the client sees a failed request; the session goes on
                flight.record.error = "replica killed"
                self._finish(rid, flight, ok=False)

    def _scale(self, event: ScaleEvent) -> None:
        for _ in range(event.add):
            self._add_replica(replica_name(self._replica_counter), fresh=True)
            self._replica_counter += 1
        for url in event.remove:
            self._kill_replica(url)

    # -- sessions and requests -----------------------------------------------------------------
    def _start_session(self, at: float, *, initial: bool = False, session: Session | None = None) -> None:
        idx = self._next_session
        self._next_session += 1
        if session is None:
            session = self.make_session(idx)
        self._sessions[idx] = session
        if not (initial and self.config.warm_start):
            batch = session.next_requests(None)
        elif self.config.warm_start_as_driver:
            # The load driver's draw: session i of a seed starts as in `kvrouter compare`.
            batch = warm_start_batch(session, self.config.seed)
        else:
            batch = fast_forward(session, self.rng)
        self._launch(idx, batch, at)

    def _turn(self, idx: int, replies: list[int | None]) -> None:
        batch = self._sessions[idx].next_requests(replies)
        self._launch(idx, batch, self.now + (batch[0].think_time_s if batch else 0.0))

    def _launch(self, idx: int, batch: list[TurnRequest], start: float) -> None:
        if not batch:
            session = self._sessions.pop(idx)
            self.keys.forget(session.session_id)
            # The session is over, but nothing tells the router: its home stays in the session
            # table until the idle TTL expires it (housekeeping), as in the live router.
            if self.arrivals is None and self.now < self.config.duration_s:
                self._start_session(self.now)  # keep the session count: closed loop
            return
        if start >= self.config.duration_s:
            return
        self._turns[idx] = _Turn(batch, [None] * len(batch), len(batch))
        for req in batch:
            self._push(start, _REQUEST, (idx, req))

    def _dispatch(self, idx: int, req: TurnRequest) -> None:
        pending = self._prepare(idx, req)
        self._start(pending, self._place(pending.summary, pending.view))

    def _prepare(self, idx: int, req: TurnRequest) -> _Pending:
        """The request as the router sees it (its summary), its client-side record, and its
        session acquired in the affinity store (ended by `_start` or `_finish`)."""
        session = self._sessions[idx]
        if self.config.eos_median is not None:  # the reply stops at EOS, max_tokens stays the cap
            req = dataclasses.replace(req, expected_output_tokens=self._eos_output(req))
        reply = session.reply_segment(req, req.expected_output_tokens)
        keys = self.keys.keys(session.session_id, req.segments + (reply,))
        prompt = req.prompt_tokens
        stride = self.stride
        prompt_pages = prompt // self.profile.page_size
        summary = RequestSummary(
            route=ROUTE, session_key=session.session_id, prompt_tokens=prompt,
            prefix_blocks=tuple(keys[stride - 1 : prompt_pages : stride]),
        )
        record = RequestRecord(session.session_id, ok=False, start_s=self.now, prompt_tokens=prompt,
                               turn_index=req.turn_index, branch_index=req.branch_index, is_edit=req.is_edit)
        view = self.affinity.acquire(session.session_id)
        return _Pending(idx, req, summary, view, keys, record)

    def _eos_output(self, req: TurnRequest) -> int:
        """The reply's length when it ends at EOS: drawn from the seed and the request alone, so
        every policy gets the same replies."""
        rng = random.Random(f"{self.config.seed}:eos:{req.session_id}:{req.turn_index}:{req.branch_index}")
        return min(req.expected_output_tokens, eos_length(rng, self.config.eos_median or 1))

    def _start(self, pending: _Pending, placement: Placement | None, error: str = "no replica") -> None:
        """Send the request where `placement` reserved it a slot (None: answer it with `error`)."""
        idx, req, record, keys = pending.idx, pending.req, pending.record, pending.keys
        if placement is None:
            self.affinity.end(req.session_id)
            record.error = error
            self.records.append(record)
            self._reply(idx, req, None)
            return
        self.decisions[placement.decision.reason] += 1
        url = placement.url
        prompt = req.prompt_tokens
        record.reason = placement.decision.reason
        record.predicted_cached_tokens = min(prompt, placement.summary.cached_tokens.get(url, 0))
        rid = f"r{next(self._rid)}"
        record.replica = url
        # Measured from the client's send, so time waiting in the router counts.
        self._flights[rid] = _Flight(req, idx, url, placement, record.start_s, record)
        output = max(1, req.expected_output_tokens)
        # The client's max_tokens, as the live load driver sends it: SGLang's admission estimate.
        try:
            self.models[url].submit(SimRequest(rid, prompt, output, keys, max_new_tokens=req.max_tokens),
                                    self.now)
        except RequestTooLarge as err:  # the replica answers 400, as SGLang does
            record.error = f"HTTP 400: {err}"
            self._finish(rid, self._flights[rid], ok=False)
            return
        placement.accepted()  # it took the request: its prompt will be cached there
        self._dirty.add(url)
        self._wake(url)

    def _place(self, summary: RequestSummary, view: SessionView,
               placement: Placement | None = None) -> Placement | None:
        """The relay's loop (router/relay.py): a crashed replica refuses the connection, which
        counts as a failure, and the request is placed again elsewhere, up to `max_attempts`.
        `placement`: the first one, already made (admission control); else the engine's."""
        if placement is None:
            placement = self.engine.place(summary, view)
        for attempt in range(self.config.max_attempts):
            if placement is None:
                return None
            placement.confirm_home_now(self.affinity)
            if placement.url in self.models:
                placement.answered()
                return placement
            placement.unreachable("connect")  # a crashed replica refuses the connection
            if attempt + 1 < self.config.max_attempts:
                placement = placement.retry()
            else:
                placement.done()
        return None

    def _finish(self, rid: str, flight: _Flight, *, ok: bool, completion: int = 0, cached: int = 0) -> None:
        del self._flights[rid]
        record = flight.record
        record.ok = ok
        if ok:
            record.e2e_s = self.now - flight.start
            record.ttft_s = (flight.first or self.now) - flight.start
            record.completion_tokens = completion
            record.cached_tokens = cached
            if completion > 1:
                record.itl_s = (record.e2e_s - record.ttft_s) / (completion - 1)
        self.records.append(record)
        flight.placement.done()
        self.affinity.end(flight.req.session_id)
        self._reply(flight.session_idx, flight.req, completion if ok else None)

    def _reply(self, idx: int, req: TurnRequest, reply: int | None) -> None:
        turn = self._turns.get(idx)
        if turn is None:
            return
        turn.replies[req.branch_index] = reply
        turn.pending -= 1
        if turn.pending == 0:
            del self._turns[idx]
            self._turn(idx, turn.replies)

    def _advance(self, url: str) -> None:
        model = self.models.get(url)
        if model is None:
            return
        self._dirty.add(url)
        for event in model.advance(self.now):
            self._on_model_event(event)
        self._wake(url)

    def _on_model_event(self, event: FirstToken | Finished) -> None:
        """A replica model's event for one of the simulator's requests."""
        flight = self._flights.get(event.rid)
        if flight is None:
            return
        if isinstance(event, FirstToken):
            flight.first = event.time
            flight.placement.prefill_answered()  # as the live relay does on the first byte
        elif isinstance(event, Finished):
            self._finish(event.rid, flight, ok=True, completion=event.completion_tokens,
                         cached=self._reported_cached(event))

    def _reported_cached(self, event: Finished) -> int:
        """The cached tokens a finished request reports to its client."""
        return event.cached_tokens

    # -- periodic work ---------------------------------------------------------------------------
    def _poll(self) -> None:
        # A replica whose model did nothing since the last poll reports the same signals, except
        # an idle one whose gauges reach SGLang's idle refresh (30 s after their last refresh).
        due = [url for url, at in self._idle_refresh.items() if at <= self.now]
        for url in sorted(self._dirty.union(due)):
            self._idle_refresh.pop(url, None)
            model = self.models.get(url)
            if model is None:
                continue
            self._publish(url, signals_of(model, self.now))
            at = model.signals.idle_refresh_at()
            if at is not None:
                self._idle_refresh[url] = at
        self._dirty.clear()
        for url in sorted(self._dead):  # the scrape of a crashed replica fails
            self.registry.record_failure(url)

    def _publish(self, url: str, signals: ReplicaSignals) -> None:
        """A poll read `signals` off `url`: the router gets them now, or `signal-lag` later."""
        delay = self.signal_delay
        if delay is None:
            self._receive(url, signals)
            return
        due = delay.publish(url, signals, self.now)
        if due != self._signal_due_at:  # one delivery event per poll
            self._signal_due_at = due
            self._push(due, _SIGNAL)

    def _deliver_signals(self) -> None:
        assert self.signal_delay is not None
        for url, signals in self.signal_delay.due(self.now):
            self._receive(url, signals)

    def _receive(self, url: str, signals: ReplicaSignals) -> None:
        """What the live poller does with a scrape (router/app.py `_on_signals`)."""
        if url not in self.models:
            return  # killed after it published
        self.registry.update_signals(url, signals)
        if signals.max_total_num_tokens:
            self.index.set_capacity(url, signals.max_total_num_tokens)

    def _housekeeping(self) -> None:
        self.table.expire(self.now)  # idle sessions past their TTL lose their home
        self.engine.settle_fresh()
        if self.now - self._last_rebalance >= self.config.rebalance_interval_s:
            self._last_rebalance = self.now
            for move in self.engine.plan_rebalance(
                self.now, self.config.rebalance_interval_s, self.config.rebalance_max_moves,
                kv_pressure=self.config.rebalance_kv_pressure,
            ):
                self.affinity.move(move.session, move.target)
                self.rebalanced += 1

    # -- main loop ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        # A large run holds millions of long-lived objects, and every full (generation-2)
        # collection walks them all (17 s of 88 s measured with gc.callbacks in a
        # 60-simulated-s 1000-replica run, when radix caches had one node per page). Young
        # collections still run; full ones wait until the run ends. Results never depend on it.
        thresholds = gc.get_threshold()
        gc.set_threshold(thresholds[0], thresholds[1], 1_000_000)
        try:
            return self._run()
        finally:
            gc.set_threshold(*thresholds)

    def _run(self) -> dict[str, Any]:
        cfg = self.config
        n_sessions = cfg.sessions if cfg.sessions is not None else 5 * cfg.replicas
        ramp = min(60.0, cfg.duration_s / 4) if cfg.ramp_s is None else cfg.ramp_s
        if self.arrivals is not None:
            for at, session in self.arrivals:
                if at < cfg.duration_s:
                    self._push(at, _ARRIVE, session)
        elif cfg.warm_start_as_driver:
            # As the load driver does: each user's first session is made when the user starts,
            # so a session that ends during the ramp gives its replacement the next index first.
            for i in range(n_sessions):
                self._push(ramp * i / max(1, n_sessions), _USER, None)
        else:
            for i in range(n_sessions):
                self._start_session(ramp * i / max(1, n_sessions), initial=True)
        for event in cfg.scale_events:
            self._push(event.at_s, _SCALE, event)
        self._push(0.0, _POLL)
        self._push(cfg.housekeeping_interval_s, _HOUSE)
        self._push(cfg.sample_interval_s, _SAMPLE)
        end = cfg.duration_s + cfg.drain_s
        while self._heap:
            at, kind, _, payload = heapq.heappop(self._heap)
            if at > end:
                break
            self.now = at
            self.events += 1
            if kind == _WAKE:
                if self._wake_at.get(payload) == at:
                    del self._wake_at[payload]
                    self._advance(payload)
            elif kind == _REQUEST:
                if payload[0] in self._sessions:
                    self._dispatch(*payload)
            elif kind == _POLL:
                self._poll()
                if at < cfg.duration_s or self._flights:
                    self._push(at + cfg.poll_interval_s, _POLL)
            elif kind == _SIGNAL:
                self._deliver_signals()
            elif kind == _HOUSE:
                self._housekeeping()
                if at < cfg.duration_s:
                    self._push(at + cfg.housekeeping_interval_s, _HOUSE)
            elif kind == _SAMPLE:
                if at <= cfg.duration_s:
                    self._sample()
                    self._push(at + cfg.sample_interval_s, _SAMPLE)
            elif kind == _SCALE:
                self._scale(payload)
            elif kind == _ARRIVE:
                self._start_session(at, session=payload)
            elif kind == _USER:
                self._start_session(at, initial=True)
        for rid, flight in list(self._flights.items()):
            flight.record.error = "unfinished at end of drain"
            self._finish(rid, flight, ok=False)
        return self.result()
