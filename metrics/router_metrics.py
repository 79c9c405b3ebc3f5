"""The router's own Prometheus metrics. Every `kvrouter_` name is declared here and nowhere else.

Each Router owns its registry (no globals), so several routers can live in one process (tests).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from .shadow_tally import ShadowTally


# Time-to-first-byte spans a warm turn (tens of ms) to a cold 100k-token prefill behind a queue.
TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 400)
PREDICTION_ERROR_BUCKETS = (-1, -0.5, -0.25, -0.1, -0.02, 0.02, 0.1, 0.25, 0.5, 1)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 400, 1000)


class _ApplyPending(Collector):
    """Registered first: any collection of the registry (a scrape, `get_sample_value`) applies
    the request path's queued counts and observations before the metrics are read."""

    def __init__(self, apply: Any) -> None:
        self._apply = apply

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        self._apply()
        return []


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._children_of: dict[str, list[tuple[Any, tuple[str, ...]]]] = {}  # replica -> its children
        self._pending_counts: dict[tuple[Any, tuple[str, ...]], float] = {}
        # (histogram, label values) -> [sum, count in bucket 0, count in bucket 1, ...]
        self._pending_histograms: dict[tuple[Any, tuple[str, ...]], list[float]] = {}
        # The shadow policies' counts (see shadow_tally.py): shadow name -> its tally, and live
        # policy name -> the sum of its picks' predicted TTFT on the decisions shadows were asked.
        self.shadow_tallies: dict[str, ShadowTally] = {}
        self.live_predicted_ttft: dict[str, float] = {}
        r = self.registry
        r.register(_ApplyPending(self.flush))
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
        self.pd_bootstrap_failures = Counter(
            "kvrouter_pd_bootstrap_failures_total",
            "Prefill/decode pairs that failed after both halves were sent (the decode half "
            "cannot get its KV), by the half that failed: prefill or decode.",
            ["stage"],
            registry=r,
        )
        self.decisions = Counter(
            "kvrouter_routing_decisions_total",
            "Routing decisions by policy and reason.",
            ["policy", "reason"],
            registry=r,
        )
        self.auth_rejections = Counter(
            "kvrouter_auth_rejections_total",
            "Client requests refused by the API-key check: 401 invalid_key, 429 key_concurrency.",
            ["reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvrouter_client_disconnects_total",
            "Requests whose client went away before the response was complete.",
            registry=r,
        )

        self.poll_errors = Counter(
            "kvrouter_replica_poll_errors_total",
            "Failed scrapes of a replica's signals.",
            ["replica"],
            registry=r,
        )
        self.signal_age = Gauge(
            "kvrouter_replica_signal_age_seconds",
            "Age of the newest polled signals of a replica.",
            ["replica"],
            registry=r,
        )
        self.polled_running = Gauge(
            "kvrouter_replica_running_requests", "Polled SGLang num_running_reqs.", ["replica"], registry=r
        )
        self.polled_queued = Gauge(
            "kvrouter_replica_queued_requests", "Polled SGLang num_queue_reqs.", ["replica"], registry=r
        )
        self.polled_token_usage = Gauge(
            "kvrouter_replica_token_usage_ratio", "Polled SGLang token_usage.", ["replica"], registry=r
        )
        self.est_cached_tokens = Counter(
            "kvrouter_estimated_cached_tokens_total",
            "Prompt tokens the router expects the chosen replica to have cached (its own CHR estimate).",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvrouter_prompt_tokens_total", "Estimated prompt tokens routed.", registry=r
        )
        # What replicas report with each response (router/usage.py, router/learning.py).
        self.cached_predicted = Counter(
            "kvrouter_cached_tokens_predicted_total",
            "Cached prompt tokens the index predicted, over responses whose replica reported its own.",
            ["replica"],
            registry=r,
        )
        self.cached_reported = Counter(
            "kvrouter_cached_tokens_reported_total",
            "Cached prompt tokens replicas reported (usage.prompt_tokens_details / meta_info).",
            ["replica"],
            registry=r,
        )
        self.cache_prediction_error = Histogram(
            "kvrouter_cache_prediction_error_ratio",
            "Per response: (reported - predicted cached tokens) / reported prompt tokens.",
            buckets=PREDICTION_ERROR_BUCKETS,
            registry=r,
        )
        self.bytes_per_token = Gauge(
            "kvrouter_bytes_per_token",
            "Calibrated prompt bytes per reported prompt token (starts at 4).",
            ["model"],
            registry=r,
        )
        self.kv_root_first = Gauge(
            "kvrouter_kv_root_first",
            "1 once the replica's reported cache hits show it evicts a conversation from its root "
            "(a plain LRU of pages): the shadow index then drops that replica's conversations whole.",
            ["replica"],
            registry=r,
        )
        self.usage_ignored = Counter(
            "kvrouter_usage_ignored_total",
            "Responses whose usage was not learnt from, by reason (missing, garbage, negative, "
            "no_cache_report, batch, unbuffered).",
            ["reason"],
            registry=r,
        )
        self.affinity_errors = Counter(
            "kvrouter_affinity_store_errors_total",
            "Affinity store operations that failed (Redis down or slow).",
            ["op"],
            registry=r,
        )
        self.affinity_degraded = Gauge(
            "kvrouter_affinity_store_degraded",
            "1 while the shared affinity store is unreachable and routing runs on local state.",
            registry=r,
        )
        self.peer_share = Counter(
            "kvrouter_peer_share_total",
            "Routing state shared with the other routers on the Redis (affinity.share_routing_state): "
            "index and session-home records published, received (another router's, applied), "
            "dropped (not sent: pending cap or a failed publish); publish_errors, subscribe_errors, "
            "bad_messages.",
            ["event"],
            registry=r,
        )
        self.sessions = Gauge("kvrouter_sessions", "Sessions in the local session table.", registry=r)
        self.sessions_evicted = Counter(
            "kvrouter_sessions_evicted_total",
            "Idle sessions evicted to stay under affinity.max_sessions, least recently used first: "
            "store=memory from this router's session table, store=redis from the shared keys.",
            ["store"],
            registry=r,
        )
        self.load_max_over_mean = Gauge(
            "kvrouter_load_max_over_mean_ratio",
            "Max over mean of in-flight requests across healthy replicas.",
            registry=r,
        )
        self.load_cv = Gauge(
            "kvrouter_load_coefficient_of_variation",
            "Coefficient of variation of in-flight requests across healthy replicas.",
            registry=r,
        )
        self.rebalanced = Counter(
            "kvrouter_sessions_rebalanced_total",
            "Idle sessions moved from hot replicas to fresh ones.",
            registry=r,
        )
        self.kv_events = Counter(
            "kvrouter_kv_events_total",
            "SGLang KV events (BlockStored, BlockRemoved, AllBlocksCleared) applied to the exact index.",
            ["replica"],
            registry=r,
        )
        self.kv_events_gaps = Counter(
            "kvrouter_kv_events_gaps_total",
            "Jumps in a replica's KV-event sequence (batches lost); replayed when possible, "
            "else that replica's index was dropped.",
            ["replica"],
            registry=r,
        )

        self.tokenizer_overflow = Counter(
            "kvrouter_tokenizer_overflow_total",
            "Requests routed without the exact KV match because every tokenizer thread and "
            "queue slot was taken (kv_events.tokenizer_threads, tokenizer_queue).",
            registry=r,
        )

        # Admission control (router/admission_gate.py): the router-side queue and SLO 429s.
        self.admission_queue_depth = Gauge(
            "kvrouter_admission_queue_depth",
            "Requests waiting in the router's admission queue, by priority class.",
            ["priority"],
            registry=r,
        )
        self.admission_wait = Histogram(
            "kvrouter_admission_wait_seconds",
            "Time requests spent in the admission queue, by priority class and how they left it "
            "(dispatched, rejected, cancelled: the client went away).",
            ["priority", "outcome"],
            buckets=TTFB_BUCKETS,
            registry=r,
        )
        self.admission_decisions = Counter(
            "kvrouter_admission_decisions_total",
            "Admission decisions when a request arrives or leaves the queue: dispatch, wait or "
            "reject, and why (free, warm_wait, cold_beats_wait, over_marks, max_wait, queue_full, "
            "behind_queue, slo, no_replica).",
            ["action", "reason"],
            registry=r,
        )
        self.admission_rejections = Counter(
            "kvrouter_admission_rejections_total",
            "Requests answered 429 because their predicted TTFT exceeded their SLO, by priority class.",
            ["priority", "reason"],
            registry=r,
        )

        self.discovery_replicas = Gauge(
            "kvrouter_discovery_replicas",
            "Replicas the discovery source currently lists (file, dns, kubernetes).",
            ["source"],
            registry=r,
        )
        self.discovery_errors = Counter(
            "kvrouter_discovery_errors_total",
            "Failed discovery refreshes (the source keeps its last known replicas).",
            ["source"],
            registry=r,
        )
        self.background_restarts = Counter(
            "kvrouter_background_restarts_total",
            "Background loops (poller, housekeeping, KV-event subscribers, discovery) restarted "
            "after an unexpected exception, by kind of loop.",
            ["task"],
            registry=r,
        )

        self.decision_log_dropped = Counter(
            "kvrouter_decision_log_dropped_total",
            "Decision-log lines dropped because the writer thread's queue was full.",
            registry=r,
        )
        # Counted on every decision by each shadow policy, through `new_shadow_tally`'s tallies (deferred).
        self.shadow_decisions = Counter(
            "kvrouter_shadow_decisions_total",
            "Decisions a shadow policy (routing.shadow) was asked for, by whether it picked the "
            "replica the live policy picked.",
            ["shadow", "agrees"],
            registry=r,
        )
        self.shadow_picks = Counter(
            "kvrouter_shadow_picks_total",
            "Decisions a shadow policy (routing.shadow) would have sent to this replica.",
            ["replica", "shadow"],
            registry=r,
        )
        self.shadow_predicted_ttft = Counter(
            "kvrouter_shadow_predicted_ttft_seconds_total",
            "With shadow policies on: sum of the predicted TTFT of each policy's picks, the live "
            "one (role=live) and each shadow (role=shadow) on the same decisions; a shadow's "
            "predicted gain is its sum minus the live one's.",
            ["policy", "role"],
            registry=r,
        )

    # -- hot-path label children -------------------------------------------------------------
    # `Metric.labels(...)` validates and hashes its arguments and takes a lock on every call; the
    # request path asks for the same few children per replica, route and reason over and over,
    # so they are looked up once and kept here (dropped with the replica in `forget_replica`).
    def child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
            if values and getattr(metric, "_labelnames", ())[:1] == ("replica",):
                self._children_of.setdefault(values[0], []).append((metric, values))
        return found

    # -- request-path counts and observations, applied when the registry is collected ---------
    # A prometheus_client `inc` or `observe` validates, takes a lock and (a histogram) scans its
    # buckets in Python: several microseconds each, several times per request. The request path
    # adds to plain numbers here instead (a histogram's bucket found by a C bisect); `flush`
    # adds them to the metrics before any collection reads the registry, so every scrape sees
    # exactly the values immediate updates would have given.
    def count(self, metric: Any, values: tuple[str, ...] = (), amount: float = 1.0) -> None:
        """`metric.labels(*values).inc(amount)` (`metric.inc(amount)` without labels), deferred.
        For counters, and gauges (a negative amount decrements)."""
        key = (metric, values)
        pending = self._pending_counts
        pending[key] = pending.get(key, 0.0) + amount

    def observe(self, metric: Any, values: tuple[str, ...], amount: float) -> None:
        """`metric.labels(*values).observe(amount)` for a Histogram (`metric.observe(amount)`
        without labels), deferred."""
        key = (metric, values)
        totals = self._pending_histograms.get(key)
        bounds = metric._upper_bounds  # ascending, ending in +Inf, as the histogram's own
        if totals is None:
            totals = self._pending_histograms[key] = [0.0] * (len(bounds) + 1)
        totals[0] += amount
        at = bisect_left(bounds, amount)  # the first bound >= amount: observe()'s bucket
        if at < len(bounds) and amount <= bounds[at]:  # (NaN lands in none, as there)
            totals[at + 1] += 1

    def new_shadow_tally(self, name: str) -> ShadowTally:
        """A new tally for the shadow policy `name` to add to until the next collection (when
        `shadow_tallies` has none for it yet)."""
        tally = self.shadow_tallies[name] = ShadowTally()
        return tally

    def _move_shadow_tallies(self) -> None:
        """Into the deferred counts: the tallies and the live sums, started afresh."""
        tallies, self.shadow_tallies = self.shadow_tallies, {}
        live, self.live_predicted_ttft = self.live_predicted_ttft, {}
        count = self.count
        for name, tally in tallies.items():
            if tally.agrees:
                count(self.shadow_decisions, (name, "true"), tally.agrees)
            if tally.disagrees:
                count(self.shadow_decisions, (name, "false"), tally.disagrees)
            for replica, n in tally.picks.items():
                count(self.shadow_picks, (replica, name), n)
            if tally.predicted_ttft_s is not None:
                count(self.shadow_predicted_ttft, (name, "shadow"), tally.predicted_ttft_s)
        for policy, total in live.items():
            count(self.shadow_predicted_ttft, (policy, "live"), total)

    def flush(self) -> None:
        """Add the deferred counts and observations to their metrics."""
        if self.shadow_tallies or self.live_predicted_ttft:
            self._move_shadow_tallies()
        counts, self._pending_counts = self._pending_counts, {}
        for (metric, values), amount in counts.items():
            (self.child(metric, *values) if values else metric).inc(amount)
        histograms, self._pending_histograms = self._pending_histograms, {}
        for (metric, values), totals in histograms.items():
            child = self.child(metric, *values) if values else metric
            child._sum.inc(totals[0])
            for bucket, n in zip(child._buckets, totals[1:]):
                if n:
                    bucket.inc(n)

    def forget_children(self, replica: str) -> None:
        """Drop the series of `replica` created through `child` (the request path's): cheap,
        for a request that ends after its replica left and may have recreated some."""
        self.flush()  # what was counted before it left is dropped with its series, as it was
        for metric, values in self._children_of.pop(replica, ()):
            self._children.pop((id(metric), values), None)
            try:
                metric.remove(*values)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def forget_replica(self, replica: str) -> None:
        """Drop every series labelled with `replica` (and the cached children that feed them),
        so a replica that left the fleet leaves no stale series behind."""
        self.forget_children(replica)
        for metric in vars(self).values():
            names = getattr(metric, "_labelnames", ())
            if not isinstance(metric, MetricWrapperBase) or "replica" not in names:
                continue
            at = names.index("replica")
            # The label sets in use, read through the public collect(); histogram samples carry
            # an extra `le` label, ignored here.
            series = {tuple(s.labels[n] for n in names)
                      for family in metric.collect() for s in family.samples
                      if s.labels.get("replica") == replica}
            for values in series:
                if values[at] == replica:
                    try:
                        metric.remove(*values)
                    except KeyError:
                        pass
