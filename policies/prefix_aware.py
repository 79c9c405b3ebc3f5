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
        loads = snapshot.load_scan(request)  # shared with other policies on this snapshot
        if not loads.least:
            return None
        p = self.params
        lo, hi, least = loads.low, loads.high, loads.least
        if hi - lo > p.balance_abs_threshold and hi > p.balance_rel_threshold * lo:
            return Decision(rng.choice(least).id, "imbalanced")
        if request.prompt_tokens > 0 and request.cached_tokens:
            top = self._best_holders(snapshot, request)
            if top:
                return Decision(rng.choice(top), "prefix_match")
        return Decision(rng.choice(least).id, "least_load")

    def _best_holders(self, snapshot: Snapshot, request: RequestSummary) -> list[str]:
        """The candidates holding the longest match, in snapshot order, if it beats the
        threshold. Walks the index's few holders, not the fleet: a candidate missing from
        the match holds 0 tokens, and 0 never beats the threshold."""
        floor = self.params.cache_threshold * request.prompt_tokens
        best, top = 0, []
        for rid, matched in request.cached_tokens.items():
            if matched <= floor or matched < best or snapshot.usable(rid, request) is None:
                continue
            if matched > best:
                best, top = matched, [rid]
            else:
                top.append(rid)
        if len(top) > 1:  # ties in snapshot order, as a scan of the candidates finds them
            chosen = set(top)
            top = [r.id for r in snapshot.candidate_views(request) if r.id in chosen]
        return top
