"""least_load: the replica with the fewest requests (polled running+queued or own in-flight).
Ties are broken uniformly at random (the injected rng). Ignores cache entirely. A baseline."""

from __future__ import annotations

import random

from .domain import Capabilities, Decision, RequestSummary, Snapshot


class LeastLoad:
    name = "least_load"
    capabilities = Capabilities()  # ignores session homes

    def decide(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random
    ) -> Decision | None:
        candidates = snapshot.candidates(request)
        if not candidates:
            return None
        low = min(r.load for r in candidates)
        ties = [r for r in candidates if r.load == low]
        return Decision(rng.choice(ties).id, "least_load")
