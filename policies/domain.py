"""The policy seam: a pure function from (snapshot, request summary, rng) to a decision.

Policies never await, never read a clock and never touch the network, so the live router and the
cluster simulator call the very same code, and tests can hand-build any situation.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, TypeVar

from .slots import slot_replacer, slot_setters

_EMPTY: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a policy may know about one replica at decision time (immutable)."""

    id: str
    healthy: bool = True
    fresh: bool = False
    in_flight: int = 0  # requests this router has dispatched and not yet completed
    in_flight_prompt_tokens: int = 0
    # Polled SGLang signals; None means unknown (never polled, or older than stale_after).
    num_running_reqs: int | None = None
    num_queue_reqs: int | None = None
    token_usage: float | None = None
    num_used_tokens: int | None = None
    max_total_num_tokens: int | None = None
    cache_hit_rate: float | None = None
    # Each DP-attention rank's (token_usage, max_total_num_tokens) on a replica of several
    # ranks (the fields above fold them: the worst rank's usage, the sum of the pools); None
    # with one rank. A request runs on one rank, within that rank's KV.
    rank_kv: tuple[tuple[float, int], ...] | None = None
    # Sessions whose home this is, and the sum of their last context sizes (their KV demand).
    homed_sessions: int = 0
    homed_tokens: int = 0
    # Requests the other routers on the fleet have in flight here, as they last published them
    # (router/peer_share.py; 0 with one router).
    peer_in_flight: int = 0
    # Uncached prompt tokens of this router's streamed requests here that have not answered
    # their first byte yet: prefill work the replica has (or is about to have) ahead of a new
    # request, known at once, while its polled queue lags (the registry keeps it, live and in
    # the simulator; 0 in hand-built views).
    pending_prefill_tokens: int = 0
    # Requests on the replica: the polled running+queued (all routers) or the routers' own
    # in-flight counts, whichever is larger, so a stale poll never hides fresh dispatches.
    # Derived once when the view is made (a view is read far more often than it is made).
    load: int = field(init=False, compare=False)
    # This view's terms of the cost model (policies/cost.py), and its verdict against a
    # placement's high-water marks, filled in on first use and kept with the view: the live
    # decision, the decision log's prediction, every shadow policy and the next decisions (a
    # view lasts until its replica changes) read them instead of recomputing. Not part of the
    # view's value; a changed view starts without.
    cost_terms: tuple[object, ...] | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        running = self.num_running_reqs
        in_flight = self.in_flight + self.peer_in_flight
        if running is not None:
            running += self.num_queue_reqs or 0
            if running > in_flight:
                in_flight = running
        object.__setattr__(self, "load", in_flight)


@dataclass(frozen=True, slots=True)
class SessionView:
    """A session's shared state, read from the affinity store before the decision."""

    key: str
    home: str | None = None
    in_flight: int = 0  # requests of this session in flight across all routers


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """The few facts about a request that routing needs; built once by the transport."""

    route: str
    session_key: str | None = None
    prompt_tokens: int = 0  # an estimate (characters / 4) unless the client sent input_ids
    model: str | None = None
    exclude: frozenset[str] = field(default_factory=frozenset)  # replicas already tried
    # Chained hashes of the prompt's prefix blocks (namespaced by model/LoRA/cache_salt).
    prefix_blocks: tuple[int, ...] = ()
    # Estimated cached prefix tokens per replica, filled in from the KV index before deciding.
    cached_tokens: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    host_cached_tokens: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    # The answer is streamed, so its first byte marks the end of its prefill; a plain answer's
    # first byte is its end, so its prefill is never counted as pending on the replica.
    streamed: bool = True


@dataclass(frozen=True, slots=True)
class LoadScan:
    """The loads of a request's candidates: what load-based policies start from."""

    low: int  # least load among the candidates (0 when there are none)
    high: int  # most load among them
    least: tuple[ReplicaView, ...]  # the candidates with the least load, in snapshot order


class FleetMemo:
    """Scans of one snapshot, made on first use and shared by every policy deciding on it (the
    live policy and the shadow policies): the same pure result, computed once. A snapshot is
    immutable, so an entry never goes stale; `Snapshot.with_session` shares its memo. Entries
    are per exclusion set (replicas a retry already tried). (Per-replica cost terms are kept
    with each replica's view: `ReplicaView.cost_terms`.)"""

    __slots__ = ("candidates", "loads")
    MAX_ENTRIES = 8  # exclusion sets differ only on retries; a long-lived snapshot stays small

    def __init__(self) -> None:
        self.candidates: dict[frozenset[str], tuple[ReplicaView, ...]] = {}
        self.loads: dict[frozenset[str], LoadScan] = {}


class FleetLoads(Protocol):
    """The load scan of every healthy replica, kept as they change (router/load_index.py)."""

    def scan_for(self, snapshot: "Snapshot") -> LoadScan | None:
        """`snapshot.load_scan` of no exclusions, or None if the replicas changed since it was
        taken (it scans its own views then)."""


_T = TypeVar("_T")


def _remember(memo: dict[frozenset[str], _T], key: frozenset[str], value: _T) -> _T:
    if len(memo) >= FleetMemo.MAX_ENTRIES:
        memo.clear()
    memo[key] = value
    return value


@dataclass(frozen=True, slots=True)
class Snapshot:
    """All replicas as seen at one instant. Policies must not keep a reference to it.

    The live registry also fills in an id index and fleet aggregates it maintains incrementally,
    so a policy can sample a 1000-replica fleet without scanning it; hand-built snapshots (tests)
    leave them out and the helpers below compute them.
    """

    replicas: tuple[ReplicaView, ...]
    session: SessionView | None = None
    by_id: Mapping[str, ReplicaView] | None = None
    healthy_load: int | None = None  # sum of `load` over healthy replicas
    healthy_count: int | None = None
    fresh: tuple[str, ...] | None = None  # ids of fresh replicas
    epoch: int | None = None  # changes whenever a replica is added or removed
    loads: tuple[int, ...] | None = None  # each replica's `load`, in `replicas` order
    # The registry's kept load scan: `load_scan` of a request that excludes no replica (a source,
    # not part of the snapshot's value).
    fleet_loads: FleetLoads | None = field(default=None, compare=False, repr=False)
    # Fleet scans already made on these replicas (not part of the snapshot's value).
    memo: FleetMemo = field(default_factory=FleetMemo, compare=False, repr=False)

    def with_session(self, session: SessionView | None) -> "Snapshot":
        made: Snapshot = snapshot_with_session(self, session)
        return made

    def candidate_views(self, request: RequestSummary) -> tuple[ReplicaView, ...]:
        """Healthy replicas not already tried for this request, in snapshot order: scanned once
        per snapshot and exclusion set, whichever policy asks first (do not mutate)."""
        exclude = request.exclude
        found = self.memo.candidates.get(exclude)
        if found is None:
            if not exclude and self.healthy_count == len(self.replicas):
                found = self.replicas  # the registry counts healthy replicas: none to drop
            elif exclude:
                found = tuple([r for r in self.replicas if r.healthy and r.id not in exclude])
            else:
                found = tuple([r for r in self.replicas if r.healthy])
            _remember(self.memo.candidates, exclude, found)
        return found

    def load_scan(self, request: RequestSummary) -> LoadScan:
        """Least and most load among the request's candidates, and the least-loaded ones;
        computed once per snapshot and exclusion set (with no exclusions, kept by the registry
        while its replicas are still the snapshot's: `fleet_loads`)."""
        exclude = request.exclude
        if not exclude and self.fleet_loads is not None:
            kept = self.fleet_loads.scan_for(self)
            if kept is not None:
                return kept
        found = self.memo.loads.get(exclude)
        if found is None:
            candidates = self.candidate_views(request)
            if candidates:
                # Builtins over a list of loads, no per-replica Python step: the least-loaded few
                # are found by `index` (in snapshot order, as a scan finds them). The registry's
                # loads serve when every replica is a candidate: no view is read at all.
                loads = self.loads
                if loads is None or candidates is not self.replicas:
                    loads = [r.load for r in candidates]
                low = min(loads)
                at = loads.index(low)
                least = [candidates[at]]
                for _ in range(loads.count(low) - 1):
                    at = loads.index(low, at + 1)
                    least.append(candidates[at])
                found = LoadScan(low, max(loads), tuple(least))
            else:
                found = LoadScan(0, 0, ())
            _remember(self.memo.loads, exclude, found)
        return found

    def candidates(self, request: RequestSummary) -> list[ReplicaView]:
        """Healthy replicas not already tried for this request, in a stable order."""
        return list(self.candidate_views(request))

    def get(self, replica_id: str) -> ReplicaView | None:
        if self.by_id is not None:
            return self.by_id.get(replica_id)
        return next((r for r in self.replicas if r.id == replica_id), None)

    def usable(self, replica_id: str, request: RequestSummary) -> ReplicaView | None:
        by_id = self.by_id  # `self.get`, without its call: every policy asks this of every decision
        view = by_id.get(replica_id) if by_id is not None else self.get(replica_id)
        if view is None or not view.healthy or replica_id in request.exclude:
            return None
        return view

    def mean_load(self) -> float:
        if self.healthy_load is not None and self.healthy_count is not None:
            return self.healthy_load / self.healthy_count if self.healthy_count else 0.0
        healthy = [r.load for r in self.replicas if r.healthy]
        return sum(healthy) / len(healthy) if healthy else 0.0

    def fresh_ids(self) -> tuple[str, ...]:
        if self.fresh is not None:
            return self.fresh
        return tuple(r.id for r in self.replicas if r.fresh)

    def sample(
        self, request: RequestSummary, k: int, rng: random.Random, first: Iterable[str] = ()
    ) -> list[ReplicaView]:
        """Usable replicas to cost: the ones named in `first`, then, in a fleet larger than `4k`,
        random others up to `k` in all (sampled in O(k)); a smaller fleet is returned whole."""
        chosen: dict[str, ReplicaView] = {}
        for rid in first:
            view = self.usable(rid, request)
            if view is not None and len(chosen) < k:
                chosen[rid] = view
        n = len(self.replicas)
        if n <= 4 * k:  # small fleet: everyone is a candidate
            for view in self.candidates(request):
                chosen.setdefault(view.id, view)
            return list(chosen.values())
        # Draws with replacement; unusable ones are skipped. `rng.choice(replicas)` draws the
        # very number `replicas[rng.randrange(n)]` does, with less call overhead; for a plain
        # `random.Random` its draw is written out (`_randbelow_with_getrandbits`: the same
        # numbers from the same stream, a third of the calls).
        replicas, exclude = self.replicas, request.exclude
        if type(rng) is random.Random:
            getrandbits, bits = rng.getrandbits, n.bit_length()
            if not chosen and not exclude and self.healthy_count == n:
                # Every replica usable (the registry counts the healthy ones), none named first:
                # only repeats to skip, by index; the sample is built as it is drawn.
                taken: set[int] = set()
                sample: list[ReplicaView] = []
                left = k
                for _ in range(4 * k):
                    at = getrandbits(bits)
                    while at >= n:
                        at = getrandbits(bits)
                    if at not in taken:
                        taken.add(at)
                        sample.append(replicas[at])
                        left -= 1
                        if not left:
                            break
                return sample
            for _ in range(4 * k):
                if len(chosen) >= k:
                    break
                at = getrandbits(bits)
                while at >= n:
                    at = getrandbits(bits)
                view = replicas[at]
                if view.healthy and view.id not in exclude and view.id not in chosen:
                    chosen[view.id] = view
            return list(chosen.values())
        choice = rng.choice
        for _ in range(4 * k):
            if len(chosen) >= k:
                break
            view = choice(replicas)
            if view.healthy and view.id not in exclude and view.id not in chosen:
                chosen[view.id] = view
        return list(chosen.values())


# `snapshot.with_session(session)` without the method's frame: a request with a session key makes
# one per decision (every other field, the memo too, shared).
snapshot_with_session = slot_replacer(Snapshot, ("session",))


@dataclass(frozen=True, slots=True, init=False)
class Decision:
    replica: str
    reason: str
    # The session's home after this request, when the decision (re)assigns it; None = unchanged.
    home: str | None = None

    def __init__(self, replica: str, reason: str, home: str | None = None) -> None:
        # Made on every decision and every shadow's: see `slot_setters`.
        _set_replica(self, replica)
        _set_reason(self, reason)
        _set_home(self, home)

    def replaces_home(self, current: str | None) -> bool:
        """Names a home other than the session's `current` one (a rehome, or a fallback away
        from an unusable home). A brand-new session's first home replaces nothing."""
        return self.home is not None and current not in (None, self.home)


_set_replica, _set_reason, _set_home = slot_setters(Decision, "replica", "reason", "home")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a policy declares to the control loop around it (scale-out housekeeping), so the
    engine never probes a policy's attributes. The defaults suit a policy that ignores homes."""

    # Decisions follow session homes, so moving an idle session's home onto a fresh replica moves
    # its future requests there (hash and load baselines leave this False: nothing to move).
    uses_affinity: bool = False
    # A fresh replica is an ordinary one again once its load reaches this x the fleet's mean.
    fresh_until_mean_ratio: float = 1.0
    # Share of a replica's KV capacity homed sessions may fill (the KV-pressure moves' target).
    capacity_target: float = 0.9
    # KV capacity assumed until a replica reports max_total_num_tokens; None: the engine's own.
    default_capacity_tokens: int | None = None


class Policy(Protocol):
    """One synchronous call shape for every policy; `None` means no replica can take the request."""

    name: str
    capabilities: Capabilities

    def decide(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random
    ) -> Decision | None: ...
