"""The cluster simulator on a prefill/decode-disaggregated fleet (`kvrouter simulate --layout pd`).

The same event loop, workload and routing engine as :class:`ClusterSimulator`; the fleet is split
into prefill servers (the routed pool: the policy, session affinity and the shadow KV index choose
among them, as in the live router's PD mode) and decode servers, chosen by the live router's own
`policies/decode_pick.py` from their polled signals and this router's in-flight counts (a second
`ReplicaRegistry`, as router/decode_pool.py keeps). Each request follows the simulated SGLang
replica's PD mode (loadtest/sim_inference.py, sim_disagg.py):

1. the prefill server runs the prompt and samples one token (its radix cache is where prefixes
   are reused; the request's cached tokens are the prefill side's);
2. the prompt's KV moves to the decode server (`Disaggregation.transfer_seconds`);
3. the decode server admits the request with its KV already there (no prefill compute) and
   streams every output token: the client's first token comes from it.

Both halves are picked when the request is sent, as the live relay picks a pair; the prefill
server's slot is held until the decode half ends (the live relay reports usage to it then).
Scale events are not modelled in this layout.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..policies.decode_pick import pick_decode
from ..router.replicas import ReplicaRegistry
from ..sglang_protocol.signals import ReplicaSignals
from .cluster_sim import _REQUEST, ClusterSimulator, _Flight, _Pending
from .cluster_config import SimConfig
from .profiles import Profile
from .replica_model import Finished, FirstToken, ReplicaModel, RequestTooLarge, SimRequest
from .sim_disagg import Disaggregation
from .turn_request import TurnRequest
from .workload import Session
from .workload_config import WorkloadConfig

PREFILL_HALF = "/prefill"  # suffix of a prefill half's request id


def decode_name(i: int) -> str:
    return f"decode-{i:04d}"


def split_fleet(servers: int, decode: int | None = None) -> tuple[int, int]:
    """(prefill, decode) servers of a fleet of `servers`: half each by default (the prefill side
    gets the odd one)."""
    if decode is None:
        decode = servers // 2
    if not 1 <= decode < servers:
        raise ValueError(f"a PD fleet of {servers} servers needs 1 to {servers - 1} decode servers, got {decode}")
    return servers - decode, decode


@dataclass(slots=True)
class _DecodeHalf:
    """The decode half of request `rid`, due once its KV has arrived (a `_REQUEST` event)."""

    rid: str


class PDClusterSimulator(ClusterSimulator):
    def __init__(
        self,
        config: SimConfig,
        policy: str,
        workload: WorkloadConfig,
        *,
        decode_servers: int | None = None,
        disaggregation: Disaggregation | None = None,
        profile: Profile | None = None,
        session_factory: Callable[[int], Session] | None = None,
        arrivals: Iterable[tuple[float, Session]] | None = None,
    ) -> None:
        if config.scale_events:
            raise ValueError("scale events are not modelled in the PD layout")
        n_prefill, n_decode = split_fleet(config.replicas, decode_servers)
        sessions = config.sessions if config.sessions is not None else 5 * config.replicas
        super().__init__(  # the routed pool is the prefill servers; the load is the whole fleet's
            dataclasses.replace(config, replicas=n_prefill, sessions=sessions), policy, workload,
            profile=profile, session_factory=session_factory, arrivals=arrivals,
        )
        self.servers = config.replicas
        self.disagg = disaggregation or Disaggregation("decode")
        self.decode_registry = ReplicaRegistry(failure_threshold=config.failure_threshold)
        self.decode_rng = random.Random(f"decode:{config.seed}")
        for i in range(n_decode):
            url = decode_name(i)
            self.models[url] = ReplicaModel(self.profile)
            self.decode_registry.add(url, fresh=False)
            self._dirty.add(url)
        self._decode_of: dict[str, str] = {}  # rid -> its decode server
        self._keys_of: dict[str, list[int]] = {}  # rid -> its page keys, for the decode half
        self._prefill_cached: dict[str, int] = {}  # rid -> the prefill side's cached tokens
        self.transfer_s_total = 0.0

    # -- the two halves --------------------------------------------------------------------------
    def _start(self, pending: _Pending, placement: Any, error: str = "no replica") -> None:
        if placement is None:
            super()._start(pending, None, error)
            return
        decision = pick_decode(self.decode_registry.snapshot(), frozenset(), self.decode_rng)
        if decision is None:
            placement.done()
            super()._start(pending, None, "no decode server")
            return
        idx, req, record, keys = pending.idx, pending.req, pending.record, pending.keys
        self.decisions[placement.decision.reason] += 1
        self.decisions[decision.reason] += 1
        url = placement.url
        rid = f"r{next(self._rid)}"
        record.replica = url
        prompt = req.prompt_tokens
        self._flights[rid] = _Flight(req, idx, url, placement, record.start_s, record)
        self._decode_of[rid] = decision.replica
        self._keys_of[rid] = keys
        self.decode_registry.dispatched(decision.replica, prompt)
        try:  # the prefill forward's one token; decoding runs on the decode server
            self.models[url].submit(SimRequest(rid + PREFILL_HALF, prompt, 1, keys,
                                               max_new_tokens=req.max_tokens), self.now)
        except RequestTooLarge as err:
            record.error = f"HTTP 400: {err}"
            self._finish(rid, self._flights[rid], ok=False)
            return
        placement.accepted()
        self._dirty.add(url)
        self._wake(url)

    def _dispatch(self, idx: int, req: TurnRequest | _DecodeHalf) -> None:  # type: ignore[override]
        if isinstance(req, _DecodeHalf):
            self._start_decode(req.rid)
        else:
            super()._dispatch(idx, req)

    def _prefill_done(self, rid: str, cached: int) -> None:
        """The prefill half ended: the KV moves to the decode server, then decoding starts."""
        flight = self._flights.get(rid)
        if flight is None:
            return
        self._prefill_cached[rid] = cached
        transfer = self.disagg.transfer_seconds(flight.req.prompt_tokens, self.profile.kv_bytes_per_token)
        self.transfer_s_total += transfer
        self._push(self.now + transfer, _REQUEST, (flight.session_idx, _DecodeHalf(rid)))

    def _start_decode(self, rid: str) -> None:
        flight = self._flights.get(rid)
        if flight is None:
            return
        url = self._decode_of[rid]
        req = flight.req
        output = max(1, req.expected_output_tokens)
        keys = self._keys_of[rid]
        try:
            self.models[url].submit(SimRequest(rid, req.prompt_tokens, output, keys,
                                               max_new_tokens=req.max_tokens, kv_transferred=True),
                                    self.now)
        except RequestTooLarge as err:
            flight.record.error = f"HTTP 400 from the decode server: {err}"
            self._finish(rid, flight, ok=False)
            return
        self._dirty.add(url)
        self._wake(url)

    def _on_model_event(self, event: FirstToken | Finished) -> None:
        if event.rid.endswith(PREFILL_HALF):  # the prefill half: its end starts the KV transfer
            if isinstance(event, Finished):
                self._prefill_done(event.rid[: -len(PREFILL_HALF)], event.cached_tokens)
            return
        super()._on_model_event(event)

    def _reported_cached(self, event: Finished) -> int:
        return self._prefill_cached.get(event.rid, 0)  # cache hits are the prefill side's

    def _finish(self, rid: str, flight: _Flight, *, ok: bool, completion: int = 0, cached: int = 0) -> None:
        decode = self._decode_of.pop(rid, None)
        if decode is not None:
            self.decode_registry.completed(decode, flight.req.prompt_tokens)
        self._prefill_cached.pop(rid, None)
        self._keys_of.pop(rid, None)
        super()._finish(rid, flight, ok=ok, completion=completion, cached=cached)

    # -- signals ---------------------------------------------------------------------------------
    def _receive(self, url: str, signals: ReplicaSignals) -> None:
        """A decode server's polled signals go to the decode registry (the live router's second
        poller); a prefill server's to the routed pool."""
        if url in self.decode_registry:
            self.decode_registry.update_signals(url, signals)
            return
        super()._receive(url, signals)

    def result(self) -> dict[str, Any]:
        out = super().result()
        out["layout"] = "pd"
        out["prefill_servers"] = self.servers - len(self.decode_registry.urls())
        out["decode_servers"] = len(self.decode_registry.urls())
        out["kv_transfer_s_total"] = self.transfer_s_total
        return out

