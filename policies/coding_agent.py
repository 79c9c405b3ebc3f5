"""coding-agent: session affinity, overflow shedding, cost-based placement, fresh replicas first.

The rules, in order (each decision's `reason` names the rule that made it):
1. affinity   A session whose home is healthy and under its high-water marks goes home. A request
              with no session id treats the replica holding most of its prefix (at least
              `prefix_home_min_fraction` of the prompt) as its home.
2. overflow   If the session already has `session_high_water` requests in flight, or the home is
              above a high-water mark (running, queued, token_usage), this request goes to the
              cheapest other replica if its expected cost (a cold prefill there) beats the cost at
              home (queueing behind the session's own requests); the home is kept either way.
3. rehome     A session whose home is gone or unhealthy is placed by cost and gets a new home.
   retry      A retry after the home failed this very request is placed by cost; home kept.
4. new_session / fresh_replica
              New sessions are placed by expected cost (policies/cost.py: queueing + prefill of
              the tokens that replica has not cached + host load-back + KV capacity penalty).
              While a fresh replica (one seen for the first time) is below the cluster's mean
              load, new sessions go to fresh replicas only.
5. fallback   Every candidate is over its high-water marks: the cheapest one still takes it.
Near-ties (cost within `tie_tolerance`) are broken by power of two choices on load, never by
index order. At most `max_candidates` replicas are costed (those holding part of the prefix,
then a random sample: power of d choices), so a decision stays cheap at 1000 replicas.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from .base import Decision, ReplicaView, RequestSummary, SessionView, Snapshot
from .cost import CostParams, expected_cost, expected_costs, prefill_s


class CodingAgentParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    session_high_water: int = Field(2, ge=1, description="A session's concurrent requests at home; more overflow.")
    replica_max_running: int = Field(40, ge=1, description="Home high-water: running+queued requests.")
    replica_max_queue: int = Field(2, ge=0, description="Home high-water: requests queued at the replica.")
    replica_max_token_usage: float = Field(0.92, gt=0, le=1.0, description="Home high-water: SGLang token_usage.")
    prefix_home_min_fraction: float = Field(0.5, ge=0, le=1.0, description="Keyless requests: cached share that makes a replica home.")
    fresh_until_mean_ratio: float = Field(1.0, gt=0, description="Fresh replicas get new sessions until load >= ratio x mean.")
    tie_tolerance: float = Field(0.01, ge=0, description="Relative cost gap still treated as a tie.")
    tie_abs_s: float = Field(0.02, ge=0, description="Absolute cost gap (seconds) still treated as a tie.")
    max_candidates: int = Field(16, ge=2, description="Replicas costed per decision: prefix holders, then a random sample.")
    sibling_new_tokens: int = Field(2000, ge=0, description="New tokens assumed per in-flight sibling request at home (its prefill runs first).")
    cost: CostParams = CostParams()


class CodingAgent:
    name = "coding_agent"
    uses_affinity = True  # its sessions have homes worth rebalancing onto fresh replicas

    def __init__(self, params: CodingAgentParams | None = None) -> None:
        self.params = params or CodingAgentParams()

    # -- high-water marks ------------------------------------------------------------------------
    def overloaded(self, r: ReplicaView) -> bool:
        p = self.params
        return (
            r.load >= p.replica_max_running
            or (r.num_queue_reqs or 0) > p.replica_max_queue
            or (r.token_usage or 0.0) > p.replica_max_token_usage
        )

    # -- the pipeline ----------------------------------------------------------------------------
    def decide(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random
    ) -> Decision | None:
        session = snapshot.session
        home_id = session.home if session is not None else self._prefix_home(snapshot, request)
        home = snapshot.usable(home_id, request) if home_id is not None else None

        if home is not None:
            session_busy = session is not None and session.in_flight >= self.params.session_high_water
            if not session_busy and not self.overloaded(home):
                return Decision(home.id, "affinity")
            others = [r for r in self._pool(snapshot, request, rng) if r.id != home.id]
            if not others:
                return Decision(home.id, "affinity")
            choice, reason = self._cheapest(others, request, rng, "overflow", placement=False)
            # Shed only where it pays: a cold prefill elsewhere must beat queueing at home.
            cost = self.params.cost
            home_cost = expected_cost(cost, home, request, is_home=True, placement=False)
            home_cost += self._sibling_wait(session, request)
            if expected_cost(cost, choice, request, placement=False) < home_cost:
                return Decision(choice.id, reason)
            return Decision(home.id, "affinity")

        keyed = session is not None and session.key is not None
        reason = "new_session"
        if session is not None and session.home is not None:
            reason = "retry" if session.home in request.exclude else "rehome"
        pool: list[ReplicaView] = []
        if reason == "new_session":
            pool = self._fresh_below_mean(snapshot, request)
            if pool:
                reason = "fresh_replica"
        if not pool:
            pool = self._pool(snapshot, request, rng)
        if not pool:
            return None
        # A retry after the home just failed this request keeps the home; others (re)assign it.
        sets_home = keyed and reason != "retry"
        choice, reason = self._cheapest(pool, request, rng, reason)
        return Decision(choice.id, reason, home=choice.id if sets_home else None)

    def _pool(self, snapshot: Snapshot, request: RequestSummary, rng: random.Random) -> list[ReplicaView]:
        """Replicas worth costing: up to half of `max_candidates` holding the most of the prefix
        (equal matches, such as a system prompt every replica holds, in random order), then a
        random sample; the whole fleet when it is that small. Holders never crowd out the sample,
        or a shared prefix would keep new sessions on the replicas that already have sessions."""
        cached = request.cached_tokens
        ranked = sorted(cached.items(), key=lambda kv: (-kv[1], kv[0]))  # stable before drawing
        holders = [r for _, _, r in sorted((-c, rng.random(), r) for r, c in ranked)]
        half = self.params.max_candidates // 2
        return snapshot.sample(request, self.params.max_candidates, rng, first=holders[:half])

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

    def _fresh_below_mean(self, snapshot: Snapshot, request: RequestSummary) -> list[ReplicaView]:
        fresh = snapshot.fresh_ids()
        if not fresh:
            return []
        limit = self.params.fresh_until_mean_ratio * snapshot.mean_load()
        views = (snapshot.usable(rid, request) for rid in fresh)
        return [r for r in views
                if r is not None and not self.overloaded(r) and (r.load < limit or r.load == 0)]

    def _cheapest(
        self,
        pool: list[ReplicaView],
        request: RequestSummary,
        rng: random.Random,
        reason: str,
        *,
        placement: bool = True,
    ) -> tuple[ReplicaView, str]:
        p = self.params
        usable = [r for r in pool if not self.overloaded(r)]
        if not usable:
            usable, reason = pool, "fallback"
        costs = expected_costs(p.cost, usable, request, placement=placement)
        best = min(costs)
        ties = [r for c, r in zip(costs, usable) if c <= best * (1 + p.tie_tolerance) + p.tie_abs_s]
        if len(ties) == 1:
            return ties[0], reason
        a, b = rng.sample(ties, 2)  # power of two choices among near-equal costs
        return (a if (a.load, a.homed_tokens) <= (b.load, b.homed_tokens) else b), reason
