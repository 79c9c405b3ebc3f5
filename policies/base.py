"""The policy seam: a pure function from (snapshot, request summary, rng) to a decision.

Policies never await, never read a clock and never touch the network, so the live router and the
cluster simulator call the very same code, and tests can hand-build any situation.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

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
    # Sessions whose home this is, and the sum of their last context sizes (their KV demand).
    homed_sessions: int = 0
    homed_tokens: int = 0

    @property
    def load(self) -> int:
        """Requests on the replica: the polled running+queued (all routers) or this router's
        own in-flight count, whichever is larger, so a stale poll never hides fresh dispatches."""
        if self.num_running_reqs is None:
            return self.in_flight
        return max(self.in_flight, self.num_running_reqs + (self.num_queue_reqs or 0))


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


@dataclass(frozen=True, slots=True)
class Snapshot:
    """All replicas as seen at one instant. Policies must not keep a reference to it."""

    replicas: tuple[ReplicaView, ...]
    session: SessionView | None = None

    def candidates(self, request: RequestSummary) -> list[ReplicaView]:
        """Healthy replicas not already tried for this request, in a stable order."""
        exclude = request.exclude
        return [r for r in self.replicas if r.healthy and r.id not in exclude]


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    reason: str
    # The session's home after this request, when the decision (re)assigns it; None = unchanged.
    home: str | None = None


class Policy(Protocol):
    """One synchronous call shape for every policy; `None` means no replica can take the request."""

    name: str

    def decide(
        self, snapshot: Snapshot, request: RequestSummary, rng: random.Random
    ) -> Decision | None: ...
