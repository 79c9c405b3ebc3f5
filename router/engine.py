"""Decide and reserve: the synchronous routing core shared by the live router and the simulator.

The transport (or the simulator) builds a RequestSummary and reads the session from its affinity
store; `place` fills in the KV-index match, takes a snapshot, asks the policy and reserves the
chosen replica's in-flight slot in one synchronous step, returning a `Placement` (router/placement.py)
that carries the rest of the request's routing: the session's home, each attempt's outcome
(replica health, retry counters), acceptance, release, retries. The live relay enters `route`,
which also acquires the request's session in the async affinity store and ends it exactly once.
The engine also owns the scale-out housekeeping: settling fresh replicas and planning bounded
session moves onto fresh replicas that arrivals alone do not fill.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from ..metrics.router_metrics import RouterMetrics
from ..policies.domain import Decision, Policy, RequestSummary, SessionView, Snapshot, snapshot_with_session
from ..policies.cost import DEFAULT_CAPACITY_TOKENS
from ..policies.predict import predict
from .kv_index import KVIndex
from .learning import UsageLearner
from .placement import DecisionNotes, Placement, RequestRoute, SessionStore
from .ranks import RankTable
from .replicas import ReplicaRegistry
from .sessions import SessionTable
from ..policies.slots import slot_replacer


# `_with_matches(summary, cached, host_cached)` is `dataclasses.replace(summary, cached_tokens=cached,
# host_cached_tokens=host_cached)` for every request with prefix blocks, without replace's field
# loop and the frozen __init__ (policies/slots.py).
_with_matches = slot_replacer(RequestSummary, ("cached_tokens", "host_cached_tokens"))


@dataclass(frozen=True, slots=True)
class Move:
    session: str
    source: str
    target: str


class RoutingEngine:
    def __init__(
        self,
        policy: Policy,
        registry: ReplicaRegistry,
        index: KVIndex,
        table: SessionTable,
        rng: random.Random,
        match_limit: int = 32,
        default_capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
        metrics: RouterMetrics | None = None,
        learner: UsageLearner | None = None,
        ranks: RankTable | None = None,
    ) -> None:
        self.ranks = ranks  # DP-attention ranks per replica (routing.dp_size > 1); None: none
        self.learner = learner  # learns from reported usage (live router); None: nothing learnt
        self.metrics = metrics  # the live router's (decisions, in-flight, cached tokens); None in the simulator
        self.default_capacity_tokens = default_capacity_tokens  # until a replica reports its own
        self.match_limit = match_limit  # policies see the deepest prefix holders, not all of them
        self.policy = policy
        self.registry = registry
        self.index = index
        self.table = table
        table.on_home_change = self.sync_homed  # replica views carry their homed totals
        self.rng = rng
        self.fresh_since: dict[str, float] = {}
        # Observability (off by default, then free): `explain` gives each placement what its
        # decision predicts (decision log, tracing); `shadows` are policies asked the same question
        # on the same snapshot, whose answers are only recorded. Their own rng leaves the live
        # policy's random stream (and so the simulator's runs) unchanged.
        self.explain = False
        self.shadows: tuple[tuple[str, Policy], ...] = ()  # (name as configured, policy)
        self.shadow_sample = 1.0  # share of decisions the shadows are asked about (routing.shadow_sample)
        self._shadow_rng = random.Random(0)
        self._shadow_sampler = random.Random(1)  # its own stream: the shadows' draws stay as they were
        # Called with the replica and whether the request was served (not retried, moved or
        # failed) each time a request's slot is released (admission control re-decides waiting
        # requests then, and counts completions); None: nobody listens.
        self.on_release: Callable[[str, bool], None] | None = None
        # Called with (predicted, observed) TTFT of a streamed request admission control
        # predicted; None: nobody listens.
        self.on_first_byte: Callable[[float, float], None] | None = None
        # Told of every record an accepted request makes in the index, and of every session home
        # (and context size) the affinity store holds after a request's claim: router/peer_share.py
        # publishes them to the other routers. None: nobody to tell.
        self.on_record: Callable[[str, tuple[int, ...]], None] | None = None
        self.on_home: Callable[[str, str, int | None], None] | None = None

    def sync_homed(self, replica: str) -> None:
        """SessionTable callback: keep the replica's homed totals in its view."""
        self.registry.set_homed(
            replica, self.table.homed_sessions.get(replica, 0), self.table.homed_tokens.get(replica, 0)
        )

    def add_replica(self, url: str, now: float, *, fresh: bool = True) -> bool:
        if not self.registry.add(url, fresh=fresh):
            return False
        self.sync_homed(url)  # a replica coming back still has sessions homed on it
        if fresh:
            self.fresh_since[url] = now
        return True

    def remove_replica(self, url: str) -> None:
        # Sessions keep the gone replica as home: their next request sees it missing and is
        # rehomed by the policy (with a shared store, other routers see the same).
        self.registry.remove(url)
        if self.learner is not None:
            self.learner.forget_order(url)
        self.index.forget(url)
        if self.ranks is not None:
            self.ranks.forget(url)
        self.fresh_since.pop(url, None)

    # -- per request ---------------------------------------------------------------------------
    def prepare(
        self, summary: RequestSummary, session: SessionView | None
    ) -> tuple[Snapshot, RequestSummary]:
        """The snapshot a decision sees, and `summary` with the KV-index match filled in."""
        if summary.prefix_blocks:
            matched = self.index.match(summary.prefix_blocks, self.match_limit)
            on_host = self.index.match_host(summary.prefix_blocks, self.match_limit)
            summary = _with_matches(summary, matched, on_host)
        return self._snapshot(session), summary

    def _snapshot(self, session: SessionView | None) -> Snapshot:
        snapshot = self.registry.snapshot()
        return snapshot_with_session(snapshot, session) if session is not None else snapshot

    def decide(
        self, summary: RequestSummary, session: SessionView | None
    ) -> tuple[Decision | None, RequestSummary]:
        """The policy's decision, and `summary` with the KV-index match filled in. Records nothing."""
        snapshot, summary = self.prepare(summary, session)
        return self.policy.decide(snapshot, summary, self.rng), summary

    def notes(self, snapshot: Snapshot, summary: RequestSummary, decision: Decision,
              shadows: tuple[tuple[str, Policy], ...] | None = None) -> DecisionNotes:
        """What `decision` predicts, and where each shadow policy (`shadows`, all of them by
        default) would have sent the request (pure calls on the same snapshot; the shadow
        metrics are counted here)."""
        if shadows is None:
            shadows = self.shadows
        live = decision.replica
        chosen = predict(snapshot, summary, live)
        predicted = {live: chosen}  # a pick already predicted is not costed again
        noted = []
        m = self.metrics
        tallies = m.shadow_tallies if m is not None and shadows else None  # see metrics/shadow_tally.py
        for name, shadow in shadows:
            other = shadow.decide(snapshot, summary, self._shadow_rng)
            guess = None
            if other is not None:
                guess = predicted.get(other.replica)
                if guess is None:
                    guess = predicted[other.replica] = predict(snapshot, summary, other.replica)
            noted.append((name, other, guess))
            if tallies is not None:
                tally = tallies.get(name) or m.new_shadow_tally(name)  # type: ignore[union-attr]
                if guess is None:
                    tally.disagrees += 1
                    continue
                picked = guess.replica
                if picked == live:
                    tally.agrees += 1
                else:
                    tally.disagrees += 1
                picks = tally.picks
                picks[picked] = picks.get(picked, 0) + 1
                if guess.ttft_s is not None:
                    tally.predicted_ttft_s = (tally.predicted_ttft_s or 0.0) + guess.ttft_s
        if tallies is not None and chosen.ttft_s is not None:
            sums, policy = m.live_predicted_ttft, self.policy.name  # type: ignore[union-attr]
            sums[policy] = sums.get(policy, 0.0) + chosen.ttft_s
        healthy = snapshot.healthy_count
        if healthy is None:
            healthy = sum(r.healthy for r in snapshot.replicas)
        if summary.exclude:
            healthy -= sum(1 for rid in summary.exclude if (v := snapshot.get(rid)) is not None and v.healthy)
        return DecisionNotes(self.policy.name, chosen, tuple(noted), healthy)

    def place(
        self,
        summary: RequestSummary,
        session: SessionView | None,
        target: str | None = None,
        *,
        retry_of: Placement | None = None,
        defer_notes: bool = False,
    ) -> Placement | None:
        """Decide and reserve the replica's in-flight slot, with no await in between: the next
        decision sees this one. `target` (a validated routing hint) bypasses the policy. None if
        no replica can take the request. `retry_of`: the request's previous placement (see
        `Placement.retry`). `defer_notes`: see `commit`."""
        if target is not None:
            if not self.registry.healthy(target):  # checked by the handler, but awaits came since
                return None
            decision: Decision | None = Decision(target, "target_hint")
        else:
            decision, summary = self.decide(summary, session)
        if decision is None:
            return None
        return self.commit(decision, summary, session, target=target, retry_of=retry_of,
                           defer_notes=defer_notes)

    def commit(
        self,
        decision: Decision,
        summary: RequestSummary,
        session: SessionView | None,
        *,
        target: str | None = None,
        retry_of: Placement | None = None,
        defer_notes: bool = False,
    ) -> Placement:
        """Reserve the slot of a decision `decide` just made (no await since): admission control
        decides, weighs waiting against it, and only then commits. The registry has not changed
        since the decision, so its notes (decision log, tracing, shadows) see the same snapshot.
        `defer_notes`: the notes are worked out by `Placement.settle_notes`, which the caller
        promises to call before its next await (the relay: once the request is on its way to
        the replica, so that they are not in its time to first byte); the snapshot is taken now
        and nothing changes the registry's views until that call."""
        notes = None
        pending = None
        shadows = self.shadows
        if (shadows and target is None and self.shadow_sample < 1.0
                and self._shadow_sampler.random() >= self.shadow_sample):
            shadows = ()  # not this decision (routing.shadow_sample)
        if target is None and (self.explain or shadows):
            if defer_notes:
                pending = (self._snapshot(session), summary, decision, shadows)
            else:
                notes = self.notes(self._snapshot(session), summary, decision, shadows)
        if self.metrics is not None:
            m = self.metrics
            m.count(m.decisions, (self.policy.name, decision.reason))
        placement = Placement(self, summary, session, decision, target=target, retry_of=retry_of,
                              notes=notes)
        if defer_notes:
            placement.defer_notes(pending)
        return placement

    def route(self, summary: RequestSummary, store: SessionStore, target: str | None = None) -> RequestRoute:
        """One request's routing in its session: `async with engine.route(...) as route:`
        acquires the session, `route.place()` places the request, leaving ends the session."""
        return RequestRoute(self, store, summary, target)

    # -- housekeeping ----------------------------------------------------------------------------
    def load_stats(self) -> tuple[float, float, float]:
        """(mean, max/mean, coefficient of variation) of load over healthy replicas."""
        loads = [r.load for r in self.registry.snapshot().replicas if r.healthy]
        if not loads:
            return 0.0, 0.0, 0.0
        mean = sum(loads) / len(loads)
        if mean == 0:
            return 0.0, 0.0, 0.0
        return mean, max(loads) / mean, statistics.pstdev(loads) / mean

    def settle_fresh(self) -> None:
        """A fresh replica whose load reached `fresh_until_mean_ratio` x the cluster mean is an
        ordinary replica again."""
        snapshot = self.registry.snapshot()  # its fleet aggregates need no scan
        mean = snapshot.mean_load()
        if mean <= 0:
            return
        limit = self.policy.capabilities.fresh_until_mean_ratio * mean
        for replica_id in snapshot.fresh_ids():
            view = snapshot.get(replica_id)
            if view is not None and view.load >= limit:
                self.registry.mark_settled(replica_id)
                self.fresh_since.pop(replica_id, None)

    def plan_rebalance(
        self,
        now: float,
        min_fresh_age_s: float,
        max_moves: int,
        *,
        kv_pressure: bool = False,
        min_idle_s: float = 120.0,
    ) -> list[Move]:
        """At most `max_moves` idle sessions to move (never one with a request in flight):
        1. onto fresh replicas still below the mean after `min_fresh_age_s`, from the hottest
           replicas, smallest context (cheapest re-prefill) first;
        2. with `kv_pressure` (off by default: in the 50 x 250 simulation it cost session balance
           and tail TTFT; on the over-committed Claude Code replay it cut TTFT p95 from 2.7 to
           2.1 s): off replicas whose homed sessions need more KV than their whole capacity (sessions grow
           turn by turn), to a replica with room under the policy's `capacity_target`: only
           sessions idle for `min_idle_s` or more, least recently active first, since under LRU
           their cache is the one already evicted and the move costs them nothing extra (moving
           recently active ones cost more cold prefills than it saved, in the simulator)."""
        capabilities = self.policy.capabilities
        if not capabilities.uses_affinity or max_moves <= 0:
            return []  # hash and load baselines ignore homes: moving one would change nothing
        views = [v for v in self.registry.snapshot().replicas if v.healthy]
        if not views:
            return []
        demand = {v.id: v.homed_tokens for v in views}
        moves = self._fill_fresh(views, demand, now, min_fresh_age_s, max_moves)
        if not kv_pressure:
            return moves
        moved = {m.session for m in moves}
        sessions = {v.id: v.homed_sessions for v in views}
        for m in moves:
            sessions[m.source] -= 1
            sessions[m.target] += 1
        fill = capabilities.capacity_target
        default_capacity = capabilities.default_capacity_tokens or self.default_capacity_tokens
        full = {v.id: float(v.max_total_num_tokens or default_capacity) for v in views}
        capacity = {v.id: fill * full[v.id] for v in views}
        for hot in sorted(views, key=lambda v: -demand[v.id] / full[v.id]):
            if demand[hot.id] <= full[hot.id] or len(moves) >= max_moves:
                break
            idle = sorted((e.last_seen, e.tokens, k) for k, e in self.table.sessions_of(hot.id)
                          if e.in_flight == 0 and k not in moved and now - e.last_seen >= min_idle_s)
            for _, tokens, key in idle:
                if demand[hot.id] <= full[hot.id] or len(moves) >= max_moves:
                    break
                # The replica with room for it and the fewest sessions (sessions bring load).
                roomy = [v for v in views if v.id != hot.id and demand[v.id] + tokens <= capacity[v.id]]
                if not roomy:
                    break
                target = min(roomy, key=lambda v: (sessions[v.id], demand[v.id] / capacity[v.id], v.id))
                moves.append(Move(key, hot.id, target.id))
                demand[hot.id] -= tokens
                demand[target.id] += tokens
                sessions[hot.id] -= 1
                sessions[target.id] += 1
        return moves

    def _fill_fresh(
        self, views: list, demand: dict[str, int], now: float, min_fresh_age_s: float, max_moves: int
    ) -> list[Move]:
        targets = [v for v in views if v.fresh and now - self.fresh_since.get(v.id, now) >= min_fresh_age_s]
        if not targets:
            return []
        mean_tokens = sum(demand.values()) / len(views)
        target_tokens = {v.id: demand[v.id] for v in targets}
        moves: list[Move] = []
        for hot in sorted(views, key=lambda v: -demand[v.id]):
            if hot.fresh or demand[hot.id] <= mean_tokens or len(moves) >= max_moves:
                break
            spare = demand[hot.id] - mean_tokens
            idle = sorted((e.tokens, k) for k, e in self.table.sessions_of(hot.id) if e.in_flight == 0)
            for tokens, key in idle:
                if len(moves) >= max_moves or tokens > spare:
                    break
                target = min(target_tokens, key=lambda t: (target_tokens[t], t))
                if target_tokens[target] + tokens > mean_tokens:
                    return moves
                moves.append(Move(key, hot.id, target))
                target_tokens[target] += tokens
                demand[hot.id] -= tokens
                demand[target] += tokens
                spare -= tokens
        return moves
