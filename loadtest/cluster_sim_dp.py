"""The cluster simulator on DP-attention replicas (`kvrouter simulate --layout dp --dp-size N`).

The same event loop, workload and routing engine as :class:`ClusterSimulator`; every replica runs
`dp_size` attention DP ranks, each a `ReplicaModel` of its own (own radix cache, KV pool and
queue; `profiles.rank_profile`, as the simulated replica's `--dp-size`). The router side is the
live router's with `routing.dp_size`: the policy chooses the replica from its signals folded over
the ranks (`sglang_protocol.signals.fold_signal`, as the live poller folds `/v1/loads`), then the
engine's `router/ranks.RankTable` chooses the rank (`policies/rank_pick.py`) from each rank's
polled signals, this router's in-flight count per rank and its shadow prefix index per rank.

Models are keyed `<replica>#dp<rank>` (`router/ranks.rank_key`); load samples are per rank, and
`tokens_per_min_per_replica` is per rank (one GPU's attention each). Scale events are not modelled
in this layout.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from ..router.placement import Placement
from ..router.ranks import RankTable, rank_key
from ..sglang_protocol.signals import ReplicaSignals, fold_rank_kv, fold_signal
from ..policies.domain import RequestSummary, SessionView
from .cluster_config import SimConfig
from .cluster_sim import ClusterSimulator, _Flight, _Pending
from .profiles import Profile, rank_profile
from .replica_model import ReplicaModel, RequestTooLarge, SimRequest
from .workload import Session
from .workload_config import WorkloadConfig

_FIELDS = tuple(f.name for f in dataclasses.fields(ReplicaSignals) if f.name != "rank_kv")


def fold_ranks(per_rank: dict[int, ReplicaSignals]) -> ReplicaSignals:
    """One replica's signals from its ranks' (what the live poller makes of `/v1/loads`)."""
    values: dict[str, Any] = {}
    for name in _FIELDS:
        vs = [v for s in per_rank.values() if (v := getattr(s, name)) is not None]
        if vs:
            values[name] = fold_signal(name, vs)
    values["rank_kv"] = fold_rank_kv([(s.token_usage, s.num_used_tokens, s.max_total_num_tokens)
                                      for _, s in sorted(per_rank.items())])
    return ReplicaSignals(**values)


class DPClusterSimulator(ClusterSimulator):
    def __init__(
        self,
        config: SimConfig,
        policy: str,
        workload: WorkloadConfig,
        *,
        dp_size: int,
        profile: Profile | None = None,
        session_factory: Callable[[int], Session] | None = None,
        arrivals: Iterable[tuple[float, Session]] | None = None,
    ) -> None:
        if config.scale_events:
            raise ValueError("scale events are not modelled in the DP layout")
        if dp_size < 2:
            raise ValueError(f"the DP layout needs a dp_size of 2 or more, got {dp_size}")
        self.dp_size = dp_size  # before the base adds the replicas
        self._rank_signals: dict[str, dict[int, ReplicaSignals]] = {}
        super().__init__(config, policy, workload, profile=profile, session_factory=session_factory,
                         arrivals=arrivals)
        block_tokens = self.profile.page_size * self.stride  # the engine's own index blocks
        self.engine.ranks = RankTable(dp_size, block_tokens)

    def _add_replica(self, url: str, *, fresh: bool) -> None:
        per_rank = rank_profile(self.profile, self.dp_size)
        for rank in range(self.dp_size):
            key = rank_key(url, rank)
            self.models[key] = ReplicaModel(per_rank)
            self._dirty.add(key)
        self.engine.add_replica(url, self.now, fresh=fresh)

    def _place(self, summary: RequestSummary, view: SessionView,
               placement: Placement | None = None) -> Placement | None:
        """Every replica is up in this layout: the engine's placement is the answer."""
        if placement is None:
            placement = self.engine.place(summary, view)
        if placement is None:
            return None
        placement.confirm_home_now(self.affinity)
        placement.answered()
        return placement

    def _start(self, pending: _Pending, placement: Placement | None, error: str = "no replica") -> None:
        """The base's dispatch (cluster_sim.py), to the model of the rank the engine chose."""
        if placement is None:
            super()._start(pending, None, error)
            return
        idx, req, record, keys = pending.idx, pending.req, pending.record, pending.keys
        self.decisions[placement.decision.reason] += 1
        url = placement.url
        key = rank_key(url, placement.rank or 0)
        rid = f"r{next(self._rid)}"
        record.replica = url
        self._flights[rid] = _Flight(req, idx, key, placement, record.start_s, record)
        output = max(1, req.expected_output_tokens)
        try:
            self.models[key].submit(SimRequest(rid, req.prompt_tokens, output, keys,
                                               max_new_tokens=req.max_tokens), self.now)
        except RequestTooLarge as err:  # the replica answers 400, as SGLang does
            record.error = f"HTTP 400: {err}"
            self._finish(rid, self._flights[rid], ok=False)
            return
        placement.accepted()
        self._dirty.add(key)
        self._wake(key)

    def _receive(self, key: str, signals: ReplicaSignals) -> None:
        url, _, rank = key.partition("#dp")
        per_rank = self._rank_signals.setdefault(url, {})
        per_rank[int(rank)] = signals
        ranks = self.engine.ranks
        assert ranks is not None
        ranks.update(url, dict(per_rank))
        folded = fold_ranks(per_rank)
        self.registry.update_signals(url, folded)
        if folded.max_total_num_tokens:
            self.index.set_capacity(url, folded.max_total_num_tokens)

    def live_sessions_per_replica(self) -> Counter[str]:
        """Sessions per replica, counted on its rank 0 (the sampling walks the models)."""
        homes = super().live_sessions_per_replica()
        return Counter({rank_key(url, 0): n for url, n in homes.items()})

    def result(self) -> dict[str, Any]:
        out = super().result()
        out["layout"] = "dp"
        out["dp_size"] = self.dp_size
        return out
