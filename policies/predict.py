"""What a decision predicts for the request: cached prompt tokens and time to first token on the
chosen replica. Pure, like the policies: the decision log, tracing and shadow policies ask it
about the same snapshot the policy decided on, and it changes nothing.

The TTFT is `cost.expected_cost` for one request (no placement terms) with the default cost
parameters: one yardstick for every policy, so shadow policies compare on equal terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import CostParams, request_cost
from .domain import RequestSummary, Snapshot

DEFAULT_COST = CostParams()


@dataclass(frozen=True, slots=True)
class Prediction:
    replica: str
    cached_tokens: int  # the KV index's match on that replica, at most the prompt
    ttft_s: float | None  # None: the replica is not in the snapshot


def predict(snapshot: Snapshot, request: RequestSummary, replica: str,
            params: CostParams = DEFAULT_COST) -> Prediction:
    cached = min(request.prompt_tokens, request.cached_tokens.get(replica, 0)) if request.cached_tokens else 0
    view = snapshot.get(replica)
    ttft = request_cost(params, view, request) if view is not None else None  # = expected_cost(placement=False)
    return Prediction(replica, cached, ttft)
