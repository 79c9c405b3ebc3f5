"""The decode servers of a prefill/decode-disaggregated fleet: their live state and the slot one
request holds on one of them.

The prefill servers are the router's ordinary replica pool (policy, affinity, KV index). The
decode servers get a registry of their own (health, this router's in-flight counts, polled
signals), filled by a second signal poller, and `policies/decode_pick.py` chooses among them.
`DecodeSlot` mirrors the outcome calls of `router/placement.Placement` that the relay makes, so
the relay streams a decode server's answer exactly as it streams a replica's.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..metrics.router_metrics import RouterMetrics
from ..policies.decode_pick import pick_decode
from .replicas import ReplicaRegistry

if TYPE_CHECKING:
    from .placement import Placement


class DecodeSlot:
    """One request's attempt on one decode server; its in-flight slot is reserved on creation."""

    __slots__ = ("pool", "url", "tokens", "ttfb_s", "status", "error", "paired", "_registration", "_held")

    def __init__(self, pool: DecodePool, url: str, tokens: int) -> None:
        self.pool, self.url, self.tokens = pool, url, tokens
        registry = pool.registry
        self._registration = registry.registration(url)
        registry.dispatched(url, tokens)
        pool.metrics.child(pool.metrics.in_flight, url).inc()
        self._held = True
        self.ttfb_s: float | None = None
        self.status: int | None = None  # the decode server's answer, once it came (tracing)
        self.error: str | None = None  # why this attempt failed (decision log, tracing)
        # The prefill placement of the pair: the client's first byte is the request's, so its
        # TTFT reaches the prefill placement (decision log, admission's TTFT calibration).
        self.paired: Placement | None = None

    def first_byte(self, seconds: float, streamed: bool = True) -> None:
        """The relay saw the decode server's first body bytes `seconds` after sending."""
        self.ttfb_s = seconds
        if self.paired is not None:
            self.paired.first_byte(seconds, streamed)

    def done(self) -> None:
        """Release the slot (idempotent)."""
        if not self._held:
            return
        self._held = False
        registry, m = self.pool.registry, self.pool.metrics
        if registry.registration(self.url) == self._registration:
            registry.completed(self.url, self.tokens)
            m.child(m.in_flight, self.url).dec()
        elif self.url not in registry:  # removed while this request ran: drop the series it
            m.forget_children(self.url)  # recreated since (as a prefill placement does)

    def unreachable(self, kind: str) -> None:
        """Never got the request: held against its health, and the request is retried."""
        self.error = kind
        self.pool.registry.record_failure(self.url)
        self._count(kind, retried=True)

    def answered(self) -> None:
        self.pool.registry.record_success(self.url)

    def refused(self, status: int) -> None:
        self._count(f"http_{status}", retried=True)

    def broke(self, kind: str) -> None:
        """Got the request, then timed out or broke off: never retried (it may still run)."""
        self.error = kind
        self._count(kind, retried=False)

    def _count(self, kind: str, *, retried: bool) -> None:
        m = self.pool.metrics
        m.child(m.upstream_errors, self.url, kind).inc()
        if retried:
            m.child(m.retries, kind).inc()


class DecodePool:
    def __init__(
        self, urls: Iterable[str], metrics: RouterMetrics, rng: random.Random, failure_threshold: int = 3
    ) -> None:
        urls = list(urls)
        self.static = set(urls)  # the config's list; discovered servers come and go apart
        self.registry = ReplicaRegistry(urls, failure_threshold)
        self.metrics = metrics
        self.rng = rng

    def add(self, url: str) -> bool:
        """A decode server joins; False if it is already there."""
        if not self.registry.add(url, fresh=False):
            return False
        self.metrics.replica_healthy.labels(url).set(1)
        return True

    def remove(self, url: str) -> bool:
        """A decode server leaves (a request on it finishes; its slot is released on the old
        registration); False if unknown."""
        if not self.registry.remove(url):
            return False
        self.metrics.forget_replica(url)  # every series labelled with it
        return True

    def set_urls(self, urls: Iterable[str]) -> list[str]:
        """A reloaded decode list: new servers join, ones the old list had and this one has
        not leave (discovered servers stay). Returns what changed."""
        urls = list(urls)
        changes = [f"+decode {url}" for url in urls if self.add(url)]
        changes += [f"-decode {url}" for url in sorted(self.static - set(urls)) if self.remove(url)]
        self.static = set(urls)
        return changes

    def place(self, exclude: frozenset[str], prompt_tokens: int) -> DecodeSlot | None:
        """Choose a decode server (not in `exclude`) and reserve its slot; None if none is left."""
        decision = pick_decode(self.registry.snapshot(), exclude, self.rng)
        if decision is None:
            return None
        m = self.metrics
        m.child(m.decisions, "decode", decision.reason).inc()
        return DecodeSlot(self, decision.replica, prompt_tokens)


class DiscoveredPDFleet:
    """Discovery's hold on a disaggregated fleet besides the routed pool
    (router/discovery.py `PDMembership`): the decode pool and the prefill bootstrap ports."""

    def __init__(self, pool: DecodePool, bootstrap_ports: dict[str, int]) -> None:
        self.pool = pool
        self.bootstrap_ports = bootstrap_ports  # shared with the PD relay, which reads it

    def add_decode(self, url: str) -> bool:
        return self.pool.add(url)

    def remove_decode(self, url: str) -> bool:
        return self.pool.remove(url)

    def set_bootstrap_ports(self, ports: dict[str, int]) -> None:
        self.bootstrap_ports.clear()
        self.bootstrap_ports.update(ports)
