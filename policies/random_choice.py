"""random: a uniformly random healthy replica, drawn from the injected rng (seeded in tests)."""

from __future__ import annotations

import random

from .domain import Capabilities, Decision, RequestSummary, Snapshot


class RandomChoice:
    name = "random"
    capabilities = Capabilities()  # ignores session homes

    def decide(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random
    ) -> Decision | None:
        candidates = snapshot.candidate_views(request)
        if not candidates:
            return None
        return Decision(rng.choice(candidates).id, "random")
