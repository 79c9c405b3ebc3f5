"""coding-agent: session affinity, overflow shedding, cost-based placement, fresh replicas first.

The rules, in order (each decision's `reason` names the rule that made it):
1. affinity   A session whose home is healthy and under its high-water marks goes home. A request
              with no session id treats the replica holding most of its prefix (at least
              `prefix_home_min_fraction` of the prompt) as its home.
   rehome_evicted
              ...unless the KV index says the home holds less than `home_lost_fraction` of the
              prompt: the engine evicted the session there, so the request (and the home) goes
              where it starts soonest, by the per-request cost; the home keeps near-ties, and
              only a replica holding the prefix or with KV room for it (`token_usage` plus the
              prompt under the mark; with DP attention, on one rank) is a candidate: none, it
              stays home (`stay_no_room`).
              Without rehome_evicted, a session stayed on a replica whose KV its neighbours kept overwriting, and a
              cold prefill there evicted theirs in turn (where KV is tight, most of the misses).
2. overflow   If the session already has `session_high_water` requests in flight, or the home is
              above a high-water mark (running, queued, token_usage), this request goes to the
              cheapest other replica if its expected cost (a cold prefill there) beats the cost at
              home (queueing behind the session's own requests); the home is kept either way.
              ...unless the home has also lost the session's prefix (and the session has fewer
              than `session_high_water` requests in flight): then the request is cold anywhere
              and is placed as `rehome_evicted`, the home moving with it
              (`lost_home_moves_with_shed`). Shed with the home kept, its KV
              landed elsewhere while the next turn went home and was cold again (in `kvrouter
              demo`, sessions far outnumbering what the KV holds: up to a third of the requests).
3. rehome     A session whose home is gone or unhealthy is placed by cost and gets a new home.
   retry      A retry after the home failed this very request is placed by cost; home kept.
4. new_session / fresh_replica / empty_replica
              New sessions are placed by expected cost (policies/cost.py: queueing + prefill of
              the tokens that replica has not cached + host load-back + KV capacity penalty).
              While a fresh replica (one seen for the first time) is under its high-water marks
              and below `fresh_until_mean_ratio` x the fleet's mean load, new sessions go to
              fresh replicas only. empty_replica: where the cheapest replica is already home
              to `empty_replica_min_homed` sessions (one), a replica no session calls home
              takes the new (keyed) session if it costs at most `empty_replica_max_extra_s`
              more: what the cheapest saves is mostly a prefix every session shares (the system
              prompt), saved once, while the sessions stacked there would queue behind each
              other's prefills on every later turn and evict each other. A fleet's first
              sessions are placed knowing nothing of how far they grow, and by the time later
              ones arrive they are the oldest, usually the longest: paired, they share a
              replica's KV and queue while other replicas sit empty.
5. fallback   Every candidate is over its high-water marks: the cheapest one still takes it.

Rules 2-5 choose with one pipeline of small steps (policies/steps.py):
    candidates  CandidateSampler (at most `max_candidates`: prefix holders, then a random
                sample, so a decision stays cheap at 1000 replicas) or fresh_below_mean
    filter      HighWater (the replica_max_* marks; none left: rule 5), `without` the home
    score       ExpectedCost (with the homed-KV terms when placing a session, without for overflow)
    pick        NearTiePowerOfTwo: costs within `tie_tolerance` (+ `tie_abs_s`) of the cheapest
                are ties, broken by power of two choices on load, never by index order.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from .domain import Capabilities, Decision, ReplicaView, RequestSummary, SessionView, Snapshot
from .cost import CostParams, expected_cost, expected_costs, prefill_s
from .steps import (CandidateSampler, ExpectedCost, HighWater, NearTiePowerOfTwo, fresh_below_mean, has_kv_room,
                    without)


class CodingAgentParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    session_high_water: int = Field(2, ge=1, description="A session's concurrent requests at home; more overflow.")
    replica_max_running: int = Field(40, ge=1, description="Home high-water: running+queued requests.")
    replica_max_queue: int = Field(2, ge=0, description="Home high-water: requests queued at the replica.")
    replica_max_token_usage: float = Field(0.92, gt=0, le=1.0, description="Home high-water: SGLang token_usage.")
    prefix_home_min_fraction: float = Field(0.5, ge=0, le=1.0, description="Keyless requests: cached share that makes a replica home.")
    home_lost_fraction: float = Field(0.5, ge=0, le=1.0, description="A home caching less than this share of the prompt has lost the session's KV: the session is placed again by cost (0 turns it off).")
    fresh_until_mean_ratio: float = Field(1.0, gt=0, description="Fresh replicas get new sessions until load >= ratio x mean.")
    empty_replica_max_extra_s: float = Field(1.0, ge=0, description="A replica no session calls home takes a new session if it costs at most this many seconds more than the cheapest, when that one is already home to empty_replica_min_homed sessions (0 turns it off).")
    empty_replica_min_homed: int = Field(1, ge=1, description="Sessions the cheapest replica must already be home to before a replica no session calls home is preferred to it.")
    lost_home_moves_with_shed: bool = Field(True, description="A session whose home is over a high-water mark and has lost its prefix is placed as rehome_evicted places it (the home moves with the request), not shed as overflow with the home kept.")
    rehome_needs_kv_room: bool = Field(True, description="A session whose home lost its prefix moves only to a replica holding its prefix or whose token_usage plus this prompt stays under replica_max_token_usage (on a DP-attention replica: some rank's); none: it stays home (stay_no_room).")
    tie_tolerance: float = Field(0.01, ge=0, description="Relative cost gap still treated as a tie.")
    tie_abs_s: float = Field(0.02, ge=0, description="Absolute cost gap (seconds) still treated as a tie.")
    max_candidates: int = Field(16, ge=2, description="Replicas costed per decision: prefix holders, then a random sample.")
    sibling_new_tokens: int = Field(2000, ge=0, description="New tokens assumed per in-flight sibling request at home (its prefill runs first).")
    cost: CostParams = CostParams()


class CodingAgent:
    name = "coding_agent"

    def __init__(self, params: CodingAgentParams | None = None) -> None:
        p = self.params = params or CodingAgentParams()
        # Its sessions have homes worth rebalancing onto fresh replicas; the control loop shares
        # its fresh-replica ratio and KV capacity model.
        self.capabilities = Capabilities(
            uses_affinity=True,
            fresh_until_mean_ratio=p.fresh_until_mean_ratio,
            capacity_target=p.cost.capacity_target,
            default_capacity_tokens=p.cost.default_capacity_tokens,
        )
        self.candidates = CandidateSampler(p.max_candidates)
        self.high_water = HighWater(p.replica_max_running, p.replica_max_queue, p.replica_max_token_usage)
        self.placement_cost = ExpectedCost(p.cost, placement=True)
        self.overflow_cost = ExpectedCost(p.cost, placement=False)
        self.pick = NearTiePowerOfTwo(p.tie_tolerance, p.tie_abs_s)

    def decide(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random
    ) -> Decision | None:
        session = snapshot.session
        home_id = session.home if session is not None else self._prefix_home(snapshot, request)
        home = snapshot.usable(home_id, request) if home_id is not None else None
        if home is not None:
            return self._home_or_overflow(snapshot, request, rng, home)
        return self._place(snapshot, request, rng)

    # -- rules 1-2: affinity, overflow -----------------------------------------------------------
    def _home_or_overflow(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random, home: ReplicaView
    ) -> Decision:
        session = snapshot.session
        session_busy = session is not None and session.in_flight >= self.params.session_high_water
        if not session_busy and not self.high_water.overloaded(home):
            if self._home_lost_prefix(home, request):
                return self._rehome_evicted(snapshot, request, rng, home)
            return Decision(home.id, "affinity")
        if self._lost_home_moves_with_shed(session_busy, home, request):
            return self._rehome_evicted(snapshot, request, rng, home)
        others = without(self.candidates(snapshot, request, rng), home.id)
        if not others:
            return Decision(home.id, "affinity")
        choice, reason = self._choose(others, request, rng, "overflow", self.overflow_cost)
        # Shed only where it pays: a cold prefill elsewhere must beat queueing at home.
        cost = self.params.cost
        home_cost = expected_cost(cost, home, request, is_home=True, placement=False)
        home_cost += self._sibling_wait(session, request)
        if expected_cost(cost, choice, request, placement=False) < home_cost:
            return Decision(choice.id, reason)
        return Decision(home.id, "affinity")

    def _home_lost_prefix(self, home: ReplicaView, request: RequestSummary) -> bool:
        """The KV index says the home holds less than `home_lost_fraction` of this prompt: the
        engine evicted the session's prefix there (only a keyed session with a prefix to match)."""
        if not request.prefix_blocks or request.prompt_tokens <= 0:
            return False
        cached = request.cached_tokens.get(home.id, 0) if request.cached_tokens else 0
        return cached < self.params.home_lost_fraction * request.prompt_tokens

    def _rehome_evicted(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random, home: ReplicaView
    ) -> Decision:
        """The engine evicted the session's prefix at home: its working set there is larger than
        the KV, which the homed-KV terms cannot see (they assume homed context fits until
        capacity_target and count sessions that already ended). The prompt is a cold prefill
        anywhere, so it goes where it starts soonest: the per-request cost (queueing, prefill of
        what each replica holds, KV pressure from `token_usage`), and the session's home moves
        with it. The home keeps near-ties."""
        others = self._under_marks(without(self.candidates(snapshot, request, rng), home.id), request)
        if not others:
            return Decision(home.id, "affinity")
        others = self._with_kv_room(others, request)
        if not others:
            return Decision(home.id, "stay_no_room")
        p = self.params
        costs = expected_costs(p.cost, [home, *others], request, home=home.id, placement=False)
        home_cost, other_costs = costs[0], costs[1:]
        if min(other_costs) >= home_cost * (1 - p.tie_tolerance) - p.tie_abs_s:
            return Decision(home.id, "affinity")
        best = self.pick(others, other_costs, rng)
        keyed = snapshot.session is not None and snapshot.session.key is not None
        return Decision(best.id, "rehome_evicted", home=best.id if keyed else None)

    def _lost_home_moves_with_shed(
        self, session_busy: bool, home: ReplicaView, request: RequestSummary
    ) -> bool:
        """An overloaded home that lost the session's prefix: the request is a cold prefill
        wherever it goes, so it is placed as `rehome_evicted` places it (the home moves with it,
        or it stays home when no candidate under its marks is clearly cheaper), not shed as
        overflow. Shed with the home kept, its KV went elsewhere while the session's next turn
        went home and found nothing there again: in a fleet with far more sessions than KV, a
        chain of cold prefills each evicting another session. A busy session
        (`session_high_water` requests in flight) is left to the overflow rule."""
        return (self.params.lost_home_moves_with_shed and not session_busy
                and self._home_lost_prefix(home, request))

    def _under_marks(self, candidates: list[ReplicaView], request: RequestSummary) -> list[ReplicaView]:
        """The candidates under the high-water marks; a DP-attention replica over the
        token_usage mark stays one if some rank has room for this prompt (`has_kv_room`, as
        `_with_kv_room` asks): the move runs on one rank, and the folded usage is the worst
        rank's, which would turn away a replica with one full rank and one empty."""
        under = self.high_water(candidates)
        if len(under) == len(candidates) or not any(r.rank_kv for r in candidates):
            return under
        hw, p = self.high_water, self.params
        return [r for r in candidates
                if not hw.overloaded(r)
                or (r.rank_kv and not hw.over_request_marks(r)
                    and has_kv_room(r, request.prompt_tokens, p.replica_max_token_usage,
                                    p.cost.default_capacity_tokens))]

    def _with_kv_room(self, others: list[ReplicaView], request: RequestSummary) -> list[ReplicaView]:
        """The replicas a session whose home lost its prefix may move to: those holding at least
        `home_lost_fraction` of the prompt (a warm move), and those whose running requests' KV
        (`token_usage`; on a DP-attention replica, some rank's) leaves room for this prompt under
        `replica_max_token_usage` (`steps.has_kv_room`). A cold move
        onto a replica without that room evicts idle sessions' prefixes there and waits for
        memory; where sessions far outnumber what the KV holds every replica is like that, and
        moving only chases KV that is not anywhere. None left: the session stays home
        (`stay_no_room`), cold there too, where its next turn finds it. `rehome_needs_kv_room`
        false keeps every candidate."""
        p = self.params
        if not p.rehome_needs_kv_room:
            return others
        prompt = request.prompt_tokens
        cached = request.cached_tokens or {}
        warm = p.home_lost_fraction * prompt
        mark = p.replica_max_token_usage
        default_capacity = p.cost.default_capacity_tokens
        return [r for r in others
                if 0 < warm <= cached.get(r.id, 0) or has_kv_room(r, prompt, mark, default_capacity)]

    # -- rules 3-5: rehome, retry, new_session / fresh_replica, fallback -------------------------
    def _place(self, snapshot: Snapshot, request: RequestSummary, rng: random.Random) -> Decision | None:
        session = snapshot.session
        keyed = session is not None and session.key is not None
        reason = "new_session"
        if session is not None and session.home is not None:
            reason = "retry" if session.home in request.exclude else "rehome"
        pool: list[ReplicaView] = []
        if reason == "new_session":
            pool = fresh_below_mean(snapshot, request, self.params.fresh_until_mean_ratio, self.high_water)
            if pool:
                reason = "fresh_replica"
        if not pool:
            pool = self.candidates(snapshot, request, rng)
        if not pool:
            return None
        # Filtered and costed once, for the empty-replica rule and the choice alike.
        usable, costs = self.placement_cost.under(pool, request, self.high_water)
        if reason == "new_session" and keyed:
            empty = self._empty_replica(usable, costs, rng)
            if empty is not None:
                return Decision(empty.id, "empty_replica", home=empty.id)
        # A retry after the home just failed this request keeps the home; others (re)assign it.
        sets_home = keyed and reason != "retry"
        choice, reason = self._choose(pool, request, rng, reason, self.placement_cost, usable, costs)
        return Decision(choice.id, reason, home=choice.id if sets_home else None)

    def _empty_replica(
        self, usable: list[ReplicaView], costs: list[float], rng: random.Random
    ) -> ReplicaView | None:
        """The cheapest usable replica that is no session's home, if the cheapest candidate is
        already home to `empty_replica_min_homed` sessions and the empty one costs at most
        `empty_replica_max_extra_s` more (None: ordinary placement). Mostly a fleet's first
        sessions: the replica holding the shared system prompt would otherwise collect them
        all (live, at 1.5 characters per token, the first four of four), or pair them (with
        `empty_replica_min_homed` 2, live where the shared prefix is large against the KV: the
        replay's first four sessions in two pairs, three of them its four longest, sharing two
        replicas' KV and queues while two replicas sat empty)."""
        p = self.params
        if p.empty_replica_max_extra_s <= 0:
            return None
        for r in usable:  # most placements: every candidate is some session's home already
            if r.homed_sessions == 0:
                break
        else:
            return None
        empty = [r for r in usable if r.homed_sessions == 0]
        if len(empty) == len(usable):
            return None
        cheapest = min(range(len(costs)), key=costs.__getitem__)
        if usable[cheapest].homed_sessions < p.empty_replica_min_homed:
            return None
        empty_costs = [c for c, r in zip(costs, usable) if r.homed_sessions == 0]
        if min(empty_costs) > costs[cheapest] + p.empty_replica_max_extra_s:
            return None
        return self.pick(empty, empty_costs, rng)

    def _choose(
        self,
        pool: list[ReplicaView],
        request: RequestSummary,
        rng: random.Random,
        reason: str,
        score: ExpectedCost,
        usable: list[ReplicaView] | None = None,
        costs: list[float] | None = None,
    ) -> tuple[ReplicaView, str]:
        """filter -> score -> pick (`usable`: `pool` already filtered, `costs` their scores);
        when every candidate is over a high-water mark the cheapest of them still takes it
        (`fallback`)."""
        if usable is None:
            usable = self.high_water(pool)
        if not usable:
            usable, reason, costs = pool, "fallback", None
        if costs is None:
            costs = score(usable, request)
        return self.pick(usable, costs, rng), reason

    def _sibling_wait(self, session: SessionView | None, request: RequestSummary) -> float:
        """Requests of the same session already at home are prefilled first: each costs about
        one warm turn (the new tokens on top of the shared history)."""
        if session is None or session.in_flight <= 0:
            return 0.0
        warm = prefill_s(self.params.cost, self.params.sibling_new_tokens, request.prompt_tokens)
        return session.in_flight * (warm + self.params.cost.decode_s_per_running)

    def _prefix_home(self, snapshot: Snapshot, request: RequestSummary) -> str | None:
        """The usable replica holding the most of the prompt, if it holds enough of it."""
        if not request.cached_tokens or request.prompt_tokens <= 0:
            return None
        usable = [kv for kv in request.cached_tokens.items() if snapshot.usable(kv[0], request)]
        if not usable:
            return None
        best, cached = max(usable, key=lambda kv: (kv[1], kv[0]))
        if cached >= self.params.prefix_home_min_fraction * request.prompt_tokens:
            return best
        return None
