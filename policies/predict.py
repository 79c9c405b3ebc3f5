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
from .slots import slot_setters

DEFAULT_COST = CostParams()


@dataclass(frozen=True, slots=True, init=False)
class Prediction:
    replica: str
    cached_tokens: int  # the KV index's match on that replica, at most the prompt
    ttft_s: float | None  # None: the replica is not in the snapshot

    def __init__(self, replica: str, cached_tokens: int, ttft_s: float | None) -> None:
        # Made for every decision noted and every shadow's pick: see `slot_setters`.
        _set_replica(self, replica)
        _set_cached_tokens(self, cached_tokens)
        _set_ttft_s(self, ttft_s)


_set_replica, _set_cached_tokens, _set_ttft_s = slot_setters(Prediction, "replica", "cached_tokens", "ttft_s")


def predict(snapshot: Snapshot, request: RequestSummary, replica: str,
            params: CostParams = DEFAULT_COST) -> Prediction:
    cached_on = request.cached_tokens
    cached = min(request.prompt_tokens, cached_on.get(replica, 0)) if cached_on else 0
    by_id = snapshot.by_id  # `snapshot.get`, without its call: this runs for every pick noted
    view = by_id.get(replica) if by_id is not None else snapshot.get(replica)
    ttft = request_cost(params, view, request) if view is not None else None  # = expected_cost(placement=False)
    prediction = _new_object(Prediction)  # `Prediction(replica, cached, ttft)` without its __init__ frame
    _set_replica(prediction, replica)
    _set_cached_tokens(prediction, cached)
    _set_ttft_s(prediction, ttft)
    return prediction


_new_object = object.__new__
