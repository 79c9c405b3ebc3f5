"""The router's replica set at run time: add, remove, drain, reload.

Discovery (router/discovery.py) and the admin API (router/admin.py) change the set through
`ReplicaMembership`; the composition root (router/app.py) hands them a `Membership`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..policies.registry import build_policy
from .config import DisaggregationConfig, RouterConfig

if TYPE_CHECKING:
    from ..metrics.router_metrics import RouterMetrics
    from .engine import RoutingEngine
    from .kv_events_subscriber import KVEventSubscriber

log = logging.getLogger("kvrouter")


class ReplicaMembership(Protocol):
    """What discovery and the admin API may do to the replica set."""

    def add(self, url: str) -> bool:
        """Add `url` as a fresh replica; False if it is already there."""
        ...

    def remove(self, url: str) -> bool:
        """Remove `url` now (requests already relayed to it finish); False if unknown."""
        ...

    def drain(self, url: str) -> bool:
        """No new requests to `url`; removed once its in-flight ones end. False if unknown."""
        ...

    def is_draining(self, url: str) -> bool: ...

    def reload(self, config: RouterConfig) -> list[str]:
        """Apply a new config's policy and replica list; returns what changed."""
        ...


class Membership:
    """The replica set of one router process, kept in step across the routing engine (registry,
    KV index, fresh replicas), the KV-event subscriber, the upstream connection pool and the
    per-replica metrics. Also holds the running config, which `reload` updates."""

    def __init__(
        self,
        config: RouterConfig,
        engine: RoutingEngine,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        *,
        forget_connections: Callable[[str], None],
        kv_events: KVEventSubscriber | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.registry = engine.registry
        self.metrics = metrics
        self.forget_connections = forget_connections  # the relay's idle connections to a replica
        self.clock = clock
        self.kv_events = kv_events
        # PD disaggregation: applies a reloaded `disaggregation:` section (decode servers,
        # bootstrap ports); returns what changed. None: not a disaggregated fleet.
        self.on_disaggregation: Callable[[DisaggregationConfig], list[str]] | None = None
        for url in self.registry.urls():  # the static list: healthy until probed otherwise
            metrics.replica_healthy.labels(url).set(1)
            metrics.in_flight.labels(url).set(0)

    def add(self, url: str) -> bool:
        added = self.engine.add_replica(url, self.clock())
        if added:
            self.metrics.replica_healthy.labels(url).set(1)
            self.metrics.flush()  # no deferred count of an earlier registration lands after this
            self.metrics.in_flight.labels(url).set(0)
            if self.kv_events is not None:
                self.kv_events.add(url)
        return added

    def remove(self, url: str) -> bool:
        if url not in self.registry:
            return False
        self.engine.remove_replica(url)
        if self.kv_events is not None:
            self.kv_events.remove(url)
        self.metrics.forget_replica(url)  # every series labelled with it
        self.forget_connections(url)  # its idle connections and parsed URL
        return True

    def drain(self, url: str) -> bool:
        if not self.registry.drain(url):
            return False
        self.metrics.replica_healthy.labels(url).set(0)
        log.info("replica %s draining", url)
        return True

    def is_draining(self, url: str) -> bool:
        return url in self.registry.draining

    def remove_drained(self) -> list[str]:
        """Remove every draining replica with no request in flight; returns them."""
        done = [u for u in list(self.registry.draining)
                if (v := self.registry.view(u)) is not None and v.in_flight == 0]
        for url in done:
            self.remove(url)
            log.info("replica %s drained and removed", url)
        return done

    def reload(self, config: RouterConfig) -> list[str]:
        """Apply a new config without dropping requests: the policy is swapped between two
        decisions and replicas are added (fresh) or removed (in-flight requests finish).
        Server, upstream and store settings need a restart. Returns what changed."""
        changes = []
        if config.policy != self.config.policy:
            self.engine.policy = build_policy(config.policy.name, config.policy.params)
            changes.append(f"policy -> {config.policy.name}")
        for url in config.replicas:
            if self.add(url):
                changes.append(f"+{url}")
        for url in set(self.config.replicas) - set(config.replicas):
            if self.remove(url):
                changes.append(f"-{url}")
        update: dict[str, object] = {"policy": config.policy, "replicas": config.replicas}
        if self.on_disaggregation is not None and config.disaggregation.enabled:
            changes += self.on_disaggregation(config.disaggregation)
            update["disaggregation"] = config.disaggregation
        self.config = self.config.model_copy(update=update)
        return changes
