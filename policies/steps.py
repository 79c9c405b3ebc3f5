"""The steps coding_agent's placement is built from: candidates -> filter -> score -> pick.

Each step is a small pure object, unit-testable on hand-built views:
- candidates  `CandidateSampler`: prefix holders first, then a random sample (power of d choices);
              `fresh_below_mean`: fresh replicas still below the fleet's mean load.
              Both yield only usable replicas (healthy, not already tried by this request).
- filter      `HighWater`: drops replicas above a high-water mark (running+queued, queue,
              token_usage); `without`: drops one replica (the home, when shedding overflow);
              `has_kv_room`: whether a prompt fits the replica's KV (per rank with DP attention).
- score       `ExpectedCost`: expected time to first token (policies/cost.py), lower is better.
- pick        `NearTiePowerOfTwo`: the cheapest, or among near-ties the less loaded of two drawn.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

from .domain import ReplicaView, RequestSummary, Snapshot
from .cost import CostParams, cold_placement_costs_under, expected_costs


# -- candidates ----------------------------------------------------------------------------------
_matched = itemgetter(1)  # a (replica, matched tokens) item's match


@dataclass(frozen=True, slots=True)
class CandidateSampler:
    """Replicas worth costing: up to half of `max_candidates` holding the most of the prefix
    (equal matches, such as a system prompt every replica holds, in random order), then a random
    sample; the whole fleet when it is that small. Holders never crowd out the sample, or a shared
    prefix would keep new sessions on the replicas that already have sessions."""

    max_candidates: int

    def __call__(self, snapshot: Snapshot, request: RequestSummary, rng: random.Random) -> list[ReplicaView]:
        cached = request.cached_tokens
        if not cached:  # a prompt nobody holds (most new sessions): nothing to rank or draw
            return snapshot.sample(request, self.max_candidates, rng)
        # Most held first, then by id (a stable sort by id, then by match descending: no Python
        # key function), so the draws below come in an order that does not depend on the index's.
        ranked = sorted(sorted(cached.items()), key=_matched, reverse=True)
        random_draw = rng.random
        holders = [r for _, _, r in sorted([(-c, random_draw(), r) for r, c in ranked])]
        half = self.max_candidates // 2
        return snapshot.sample(request, self.max_candidates, rng, first=holders[:half])


def fresh_below_mean(
    snapshot: Snapshot, request: RequestSummary, ratio: float, high_water: "HighWater"
) -> list[ReplicaView]:
    """Usable fresh replicas under their high-water marks whose load is still below `ratio` x the
    fleet's mean load (or zero: an idle fleet's fresh replicas are below any mean)."""
    fresh = snapshot.fresh_ids()
    if not fresh:
        return []
    limit = ratio * snapshot.mean_load()
    views = (snapshot.usable(rid, request) for rid in fresh)
    return [r for r in views
            if r is not None and not high_water.overloaded(r) and (r.load < limit or r.load == 0)]


# -- filters -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HighWater:
    """The high-water marks: a replica above any of them takes no new work while another can."""

    max_running: int  # running+queued requests (`ReplicaView.load`)
    max_queue: int  # requests queued at the replica
    max_token_usage: float  # SGLang token_usage

    def overloaded(self, r: ReplicaView) -> bool:
        # `over_request_marks` inlined: asked of a session's home on every decision.
        return (r.load >= self.max_running or (r.num_queue_reqs or 0) > self.max_queue
                or (r.token_usage or 0.0) > self.max_token_usage)

    def over_request_marks(self, r: ReplicaView) -> bool:
        """Above the running+queued or the queue mark (the marks other than token_usage)."""
        return r.load >= self.max_running or (r.num_queue_reqs or 0) > self.max_queue

    def __call__(self, candidates: Sequence[ReplicaView]) -> list[ReplicaView]:
        # `overloaded`, inlined: this runs on every candidate of every decision.
        running, queue, usage = self.max_running, self.max_queue, self.max_token_usage
        return [r for r in candidates
                if not (r.load >= running or (r.num_queue_reqs or 0) > queue
                        or (r.token_usage or 0.0) > usage)]


def has_kv_room(r: ReplicaView, prompt_tokens: int, max_token_usage: float, default_capacity: int) -> bool:
    """The KV in use on `r` (`token_usage`, none when unknown) plus `prompt_tokens` stays at or
    under `max_token_usage` of its pool (`default_capacity` when unknown). On a replica of
    several DP-attention ranks the request runs on one rank, within that rank's pool: room is
    some rank's room. (The folded view would mislead both ways: the worst rank's usage hides
    an empty rank, the sum of the pools shows room for a prompt no one rank holds.)"""
    if r.rank_kv:
        return any(usage + prompt_tokens / pool <= max_token_usage for usage, pool in r.rank_kv)
    return (r.token_usage or 0.0) + prompt_tokens / (r.max_total_num_tokens or default_capacity) <= max_token_usage


def without(candidates: Sequence[ReplicaView], replica_id: str) -> list[ReplicaView]:
    """The candidates other than `replica_id`."""
    return [r for r in candidates if r.id != replica_id]


# -- scorer --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ExpectedCost:
    """Seconds to first token on each candidate (lower is better). With `placement` (a session
    being homed there) the score also counts the KV and sessions already homed there."""

    params: CostParams
    placement: bool = True

    def __call__(self, candidates: Sequence[ReplicaView], request: RequestSummary) -> list[float]:
        return expected_costs(self.params, candidates, request, placement=self.placement)

    def under(
        self, candidates: Sequence[ReplicaView], request: RequestSummary, marks: "HighWater"
    ) -> tuple[list[ReplicaView], list[float]]:
        """`marks(candidates)` and their scores; for a placement of a prompt nobody holds (most
        new sessions) in one pass over the candidates."""
        if self.placement:
            found = cold_placement_costs_under(
                self.params, candidates, request, (marks.max_running, marks.max_queue, marks.max_token_usage))
            if found is not None:
                return found
        usable = marks(candidates)
        return usable, self(usable, request)


# -- picker --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NearTiePowerOfTwo:
    """The lowest score; when several are within `tolerance` (relative) + `abs_s` of it, two of
    those drawn at random and the one with less load (then less homed KV) wins: never index order,
    so equal-cost replicas share new sessions instead of the first one taking them all."""

    tolerance: float
    abs_s: float

    def __call__(
        self, candidates: Sequence[ReplicaView], scores: Sequence[float], rng: random.Random
    ) -> ReplicaView:
        limit = min(scores) * (1 + self.tolerance) + self.abs_s
        ties = []  # a loop here, not a comprehension: no call (this runs on every placement)
        for c, r in zip(scores, candidates):
            if c <= limit:
                ties.append(r)
        if len(ties) == 1:
            return ties[0]
        a, b = _two_of(ties, rng)
        # `(a.load, a.homed_tokens) <= (b.load, b.homed_tokens)`, without the two tuples
        if a.load != b.load:
            return a if a.load < b.load else b
        return a if a.homed_tokens <= b.homed_tokens else b


def _two_of(ties: list[ReplicaView], rng: random.Random) -> tuple[ReplicaView, ReplicaView]:
    """`rng.sample(ties, 2)`. For a plain `random.Random` its two draws are written out (the
    same numbers from the same stream, as `Random.sample` makes them for k=2), without its
    argument checks and pool copy: this runs on most placements. Fewer than two ties (NaN
    scores match no limit) raise as `sample` does: the written-out draws would never end."""
    if type(rng) is not random.Random or len(ties) < 2:
        a, b = rng.sample(ties, 2)
        return a, b
    n = len(ties)
    getrandbits = rng.getrandbits
    bits = n.bit_length()
    i = getrandbits(bits)
    while i >= n:
        i = getrandbits(bits)
    if n <= 21:  # sample() draws from a shrinking pool: the first pick's slot takes the last one
        bits = (n - 1).bit_length()
        j = getrandbits(bits)
        while j >= n - 1:
            j = getrandbits(bits)
        return ties[i], ties[n - 1 if j == i else j]
    j = i  # a larger population: draws again until the second index differs
    while j == i:
        j = getrandbits(bits)
        while j >= n:
            j = getrandbits(bits)
    return ties[i], ties[j]
