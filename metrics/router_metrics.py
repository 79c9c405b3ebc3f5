"""The router's own Prometheus metrics. Every `kvrouter_` name is declared here and nowhere else.

Each Router owns its registry (no globals), so several routers can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Time-to-first-byte spans a warm turn (tens of ms) to a cold 100k-token prefill behind a queue.
TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 400)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 400, 1000)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvrouter_requests_total",
            "Client requests finished, by route and HTTP status sent to the client.",
            ["route", "status"],
            registry=r,
        )
        self.upstream_ttfb = Histogram(
            "kvrouter_upstream_ttfb_seconds",
            "Time from dispatch to the first response byte from the replica.",
            ["replica"],
            buckets=TTFB_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "kvrouter_request_duration_seconds",
            "Total time from request received to last byte relayed.",
            ["route"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "kvrouter_replica_in_flight_requests",
            "Requests this router has dispatched to a replica and not yet completed.",
            ["replica"],
            registry=r,
        )
        self.replica_healthy = Gauge(
            "kvrouter_replica_healthy",
            "1 if the replica may receive new work, else 0.",
            ["replica"],
            registry=r,
        )
        self.retries = Counter(
            "kvrouter_upstream_retries_total",
            "Attempts retried on another replica before the first byte, by cause.",
            ["reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvrouter_upstream_errors_total",
            "Upstream failures by replica and kind.",
            ["replica", "kind"],
            registry=r,
        )
        self.decisions = Counter(
            "kvrouter_routing_decisions_total",
            "Routing decisions by policy and reason.",
            ["policy", "reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvrouter_client_disconnects_total",
            "Requests whose client went away before the response was complete.",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def forget_replica(self, replica: str) -> None:
        for metric in (self.in_flight, self.replica_healthy):
            try:
                metric.remove(replica)
            except KeyError:
                pass
