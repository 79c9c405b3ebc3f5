"""The DP-attention rank of a replica the policy chose (SGLang ``--enable-dp-attention``).

Each rank of such a replica has its own radix cache and its own queue, so the choice of rank is
a small placement of its own: the rank holding the longest cached prefix of the request, unless
it is busier than the least loaded rank by more than `max_extra_load` requests (then the least
loaded rank: queueing there costs more than the prefix saves); ties go to the lower KV usage,
then the lower rank. Pure: rank views in, rank out.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_EXTRA_LOAD = 2  # requests a cache-holding rank may have over the least loaded one


@dataclass(frozen=True, slots=True)
class RankView:
    rank: int
    load: int = 0  # running + queued (polled) or this router's in-flight, the larger
    token_usage: float = 0.0
    cached_tokens: int = 0  # of this request's prefix, by the router's rank index


def pick_rank(ranks: tuple[RankView, ...], max_extra_load: int = MAX_EXTRA_LOAD) -> int:
    """The rank to send the request to (`ranks` non-empty)."""
    least = min(r.load for r in ranks)
    fits = [r for r in ranks if r.load <= least + max_extra_load]
    best = max(fits, key=lambda r: (r.cached_tokens, -r.load, -r.token_usage, -r.rank))
    if best.cached_tokens > 0:
        return best.rank
    return min(ranks, key=lambda r: (r.load, r.token_usage, r.rank)).rank
