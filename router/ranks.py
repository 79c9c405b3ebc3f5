"""DP-attention ranks of the routed replicas: per-rank load and KV, and the rank a request gets.

With `routing.dp_size` > 1 every replica runs that many attention DP ranks, each with its own
radix cache and queue. The policy still chooses the replica (its signals fold the ranks
together); this table then chooses the rank (`policies/rank_pick.py`) from what it knows per
rank: the polled `/v1/loads` entry of each `dp_rank`, this router's own in-flight count per rank,
and a shadow prefix index per rank (fed, like the replica index, by requests the rank served).
The relay tells SGLang the rank with `routed_dp_rank` (and, in PD mode, a bootstrap room with
room % dp_size == rank, which is where SGLang's decode side looks for the KV).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..policies.rank_pick import RankView, pick_rank
from ..sglang_protocol.signals import ReplicaSignals
from .json_splice import SplicedBody, with_member
from .kv_index_shadow import ShadowKVIndex


def routed_body(body: bytes | SplicedBody, rank: int) -> SplicedBody:
    """The request body with SGLang's ``routed_dp_rank`` set (the handler checked it is a JSON
    object): the member is added to the client's bytes, which are not re-serialized."""
    return with_member(body, b'"routed_dp_rank":%d' % rank)


def room_for_rank(random_room: int, rank: int, dp_size: int) -> int:
    """A bootstrap room with room % dp_size == rank, below 2**63 like `random_room`: SGLang's
    decode side looks for the KV on prefill rank room % dp_size (SGLang re-rooms the same way)."""
    return random_room // dp_size * dp_size + rank


def rank_key(replica: str, rank: int) -> str:
    """The rank's key in the rank index (never a URL: '#' cannot be in a replica URL)."""
    return f"{replica}#dp{rank}"


class RankTable:
    def __init__(self, dp_size: int, block_tokens: int) -> None:
        self.dp_size = dp_size
        self.index = ShadowKVIndex(block_tokens=block_tokens)
        self._signals: dict[str, dict[int, ReplicaSignals]] = {}
        self._in_flight: dict[str, int] = {}

    def update(self, replica: str, per_rank: dict[int, ReplicaSignals]) -> None:
        """A poll's per-rank loads of `replica`."""
        self._signals[replica] = per_rank
        for rank, signals in per_rank.items():
            if signals.max_total_num_tokens:
                self.index.set_capacity(rank_key(replica, rank), int(signals.max_total_num_tokens))

    def polled(self, replica: str) -> bool:
        """Per-rank loads of `replica` have come in."""
        return replica in self._signals

    def forget(self, replica: str) -> None:
        self._signals.pop(replica, None)
        for rank in range(self.dp_size):
            self.index.forget(rank_key(replica, rank))
            self._in_flight.pop(rank_key(replica, rank), None)

    def views(self, replica: str, blocks: Sequence[int]) -> tuple[RankView, ...]:
        signals = self._signals.get(replica, {})
        cached = self.index.match(blocks) if blocks else {}
        views = []
        for rank in range(self.dp_size):
            key = rank_key(replica, rank)
            s = signals.get(rank)
            polled = None if s is None or s.num_running_reqs is None else int(
                s.num_running_reqs + (s.num_queue_reqs or 0))
            own = self._in_flight.get(key, 0)
            views.append(RankView(
                rank,
                load=own if polled is None else max(own, polled),
                token_usage=(s.token_usage or 0.0) if s is not None else 0.0,
                cached_tokens=cached.get(key, 0),
            ))
        return tuple(views)

    def choose(self, replica: str, blocks: Sequence[int]) -> int:
        return pick_rank(self.views(replica, blocks))

    def dispatched(self, replica: str, rank: int) -> None:
        key = rank_key(replica, rank)
        self._in_flight[key] = self._in_flight.get(key, 0) + 1

    def completed(self, replica: str, rank: int) -> None:
        key = rank_key(replica, rank)
        self._in_flight[key] = max(0, self._in_flight.get(key, 0) - 1)

    def served(self, replica: str, rank: int, blocks: Sequence[int]) -> None:
        """The rank took the request: its cache will hold the prompt."""
        if blocks:
            self.index.record(rank_key(replica, rank), blocks)
