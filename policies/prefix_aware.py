"""prefix_aware: SGLang-router-style cache-aware routing. A baseline.

As in the SGLang model gateway's `cache_aware` policy: if the load is imbalanced
((max - min) > balance_abs_threshold and max > balance_rel_threshold * min) route to the least
loaded replica; otherwise, if the best prefix match covers more than `cache_threshold` of the
prompt, route to that replica; otherwise to the least loaded one. No session affinity beyond
what the prefix match gives, no capacity model. Defaults are the gateway's documented ones.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from .domain import Capabilities, Decision, RequestSummary, Snapshot


class PrefixAwareParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    cache_threshold: float = Field(0.3, ge=0, le=1, description="Match ratio above which the best match wins.")
    balance_abs_threshold: int = Field(64, ge=0, description="Load spread (requests) that counts as imbalanced...")
    balance_rel_threshold: float = Field(1.5, ge=1, description="...together with max > rel x min.")


class PrefixAware:
    name = "prefix_aware"
    capabilities = Capabilities()  # ignores session homes

    def __init__(self, params: PrefixAwareParams | None = None) -> None:
        self.params = params or PrefixAwareParams()

    def decide(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random
    ) -> Decision | None:
        candidates = snapshot.candidates(request)
        if not candidates:
            return None
        p = self.params
        loads = [r.load for r in candidates]
        lo, hi = min(loads), max(loads)
        least = [r for r in candidates if r.load == lo]
        if hi - lo > p.balance_abs_threshold and hi > p.balance_rel_threshold * lo:
            return Decision(rng.choice(least).id, "imbalanced")
        if request.prompt_tokens > 0 and request.cached_tokens:
            matched = [(request.cached_tokens.get(r.id, 0), r) for r in candidates]
            best = max(m for m, _ in matched)
            if best > p.cache_threshold * request.prompt_tokens:
                top = [r for m, r in matched if m == best]
                return Decision(rng.choice(top).id, "prefix_match")
        return Decision(rng.choice(least).id, "least_load")
