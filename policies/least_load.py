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
        least = snapshot.load_scan(request).least  # shared with any other policy on this snapshot
        if not least:
            return None
        return Decision(rng.choice(least).id, "least_load")
