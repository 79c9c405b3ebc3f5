"""round_robin: each request to the next healthy replica in turn; ignores load and cache."""

from __future__ import annotations

import random

from .domain import Capabilities, Decision, RequestSummary, Snapshot


class RoundRobin:
    name = "round_robin"
    capabilities = Capabilities()  # ignores session homes

    def __init__(self) -> None:
        self._next = 0

    def decide(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random
    ) -> Decision | None:
        candidates = snapshot.candidate_views(request)
        if not candidates:
            return None
        choice = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(choice.id, "round_robin")
