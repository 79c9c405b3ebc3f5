"""The composition root: builds the router's parts, its data-port server and its lifecycle.

The parts live in modules of their own: the request handlers (router/handlers.py), the
middlewares (router/middlewares.py), the replica set at run time (router/membership.py), the
once-a-second loop (router/housekeeping.py), the routing engine and the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable

from ..metrics.router_metrics import RouterMetrics
from ..sglang_protocol.signals import ReplicaSignals
from ..policies.domain import Policy
from ..policies.registry import build_policy
from .admission import policy_marks
from .admission_gate import AdmissionGate
from .affinity import AffinityStore, MemoryAffinityStore, RedisAffinityStore
from .config import ConfigError, DisaggregationConfig, RouterConfig
from .data_server import DataServer, Handler, Middleware
from .decision_log import DecisionLog, worker_path
from .decode_pool import DecodePool, DiscoveredPDFleet
from .discovery import discovery_ctx
from .engine import RoutingEngine
from .handlers import Handlers
from .housekeeping import Housekeeping
from .kv_index_exact import ExactKVIndex, request_blocks
from .kv_events_subscriber import KVEventSubscriber
from .kv_index import KVIndex
from .kv_index_shadow import ShadowKVIndex
from .peer_share import PeerShare, share_channel
from .learning import UsageLearner
from .membership import Membership
from .middlewares import INFERENCE_ROUTES, auth_middleware, errors_middleware
from .pd_relay import PDForwarder
from .poller import SignalPoller
from .ranks import RankTable
from .relay import Relay
from .replicas import ReplicaRegistry
from .security import KeyLimiter, load_api_keys, redact_url
from .sessions import SessionTable
from .summary import ExactBlocks
from .supervise import spawn
from .tokenizers import TokenizePool, load_tokenizer
from .tracing import Tracing, TracingUnavailable
from .tracing import wanted as tracing_wanted

log = logging.getLogger("kvrouter")


async def _cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Stop the router's background loops and wait until each has."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Router:
    """The composition root of one router process: builds the routing engine, the affinity
    store, the relay, the replica membership, the handlers and the background loops, and wires
    them into the data port's server (`build_server`), whose lifecycle starts and stops them."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        policy: Policy | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        worker: int | None = None,
    ) -> None:
        self.worker = worker  # index under `serve --workers N`, else None
        self.clock = clock
        self.metrics = RouterMetrics()
        self.registry = ReplicaRegistry(config.replicas, config.signals.failure_threshold)
        policy = policy or build_policy(config.policy.name, config.policy.params)
        self.index: KVIndex
        self.kv_events: KVEventSubscriber | None = None
        self._exact_blocks: ExactBlocks | None = None
        self.tokenize_pool: TokenizePool[tuple[int, tuple[int, ...]]] | None = None
        kv = config.kv_events
        if kv.enabled:
            self.index = exact = ExactKVIndex(kv.page_size)
            self.kv_events = KVEventSubscriber(exact, kv, self.metrics)
            self._exact_blocks = functools.partial(
                request_blocks, load_tokenizer(kv.tokenizer), page_size=kv.page_size
            )
            if kv.tokenizer_threads:  # tokenizing a large prompt must not stall the loop
                self.tokenize_pool = TokenizePool(
                    self._exact_blocks, kv.tokenizer_threads, kv.tokenizer_queue,
                    on_full=self.metrics.tokenizer_overflow.inc,
                )
        else:
            self.index = ShadowKVIndex(block_tokens=max(1, config.routing.block_chars // 4))
        evicted = self.metrics.sessions_evicted
        self.table = SessionTable(config.routing.session_ttl_s, max_sessions=config.affinity.max_sessions,
                                  on_evict=evicted.labels("memory").inc)
        learn = config.learning
        if isinstance(self.index, ShadowKVIndex):
            self.index.learnt_below_reported = learn.learnt_capacity == "always"
        self.learner = UsageLearner(
            block_chars=config.routing.block_chars, weight=learn.ewma_weight, calibrate=learn.calibrate,
            index=self.index if isinstance(self.index, ShadowKVIndex) else None, metrics=self.metrics,
            # With DP attention a request may land on another rank than the conversation's,
            # whose hit looks like an eviction: the order is not learnt there.
            learn_order=learn.eviction_order == "learn" and config.routing.dp_size == 1,
        )
        dp_size = config.routing.dp_size
        rank_blocks = kv.page_size if kv.enabled else max(1, config.routing.block_chars // 4)
        self.ranks = RankTable(dp_size, rank_blocks) if dp_size > 1 else None
        self.engine = RoutingEngine(
            policy, self.registry, self.index, self.table, rng or random.Random(),
            metrics=self.metrics, learner=self.learner, ranks=self.ranks,
        )
        # The replica set at run time, and the running config (`self.config`) it reloads.
        self.membership = Membership(config, self.engine, self.metrics, clock,
                                     forget_connections=lambda url: self.relay.pool.forget_replica(url),
                                     kv_events=self.kv_events)
        self.affinity = self._make_affinity_store()
        self.peer_share = self._make_peer_share()
        self.api_keys = load_api_keys(config.auth)
        self.key_limiter = KeyLimiter(config.auth.max_concurrent_per_key)
        inject: dict[str, str] = {}
        drop = [config.routing.target_hint_header]
        if config.upstream.api_key_env:
            upstream_key = os.environ.get(config.upstream.api_key_env, "")
            if upstream_key:
                inject["Authorization"] = f"Bearer {upstream_key}"
        if self.api_keys or inject:
            drop.append("authorization")  # the client's key is for the router, not the replicas
        self.relay = Relay(self.engine, self.affinity, self.metrics, config.upstream, clock,
                           replica_header=config.server.replica_header,
                           drop_headers=tuple(drop), inject_headers=inject, worker=worker)
        if config.admission.active:  # off: not even a hook on the request path
            self.relay.admission = AdmissionGate(config.admission, self.engine, self.metrics, clock,
                                                 *policy_marks(policy))  # kept up with reloads
        self.poller = SignalPoller(
            self.registry, self.metrics, config.signals, clock, on_signals=self._on_signals,
            on_rank_loads=self.ranks.update if self.ranks is not None else None, headers=inject,
        )
        obs = config.observability
        self.decision_log: DecisionLog | None = None
        if obs.decision_log:
            path = worker_path(obs.decision_log, worker)
            try:
                self.decision_log = DecisionLog(
                    path, max_bytes=obs.decision_log_max_bytes, backups=obs.decision_log_backups,
                    queue_size=obs.decision_log_queue, on_drop=self.metrics.decision_log_dropped.inc)
            except OSError as err:
                raise ConfigError(f"observability.decision_log: cannot write {path} ({err.strerror})") from None
            self.relay.decision_log = self.decision_log
            self.engine.explain = True
        self.engine.shadows = tuple((name, build_policy(name)) for name in config.routing.shadow)
        self.engine.shadow_sample = config.routing.shadow_sample
        self.tracing = self._make_tracing(config)
        if self.tracing is not None:
            self.relay.tracing = self.tracing
            self.engine.explain = True
        # PD disaggregation: the replica pool above is the prefill servers; the decode servers
        # have their own registry and poller, and the relay sends each request to a pair.
        self.decode_pool: DecodePool | None = None
        self.decode_poller: SignalPoller | None = None
        pd = config.disaggregation
        if pd.enabled:
            self.decode_pool = DecodePool(pd.decode, self.metrics, random.Random(),
                                          config.signals.failure_threshold)
            self.decode_poller = SignalPoller(self.decode_pool.registry, self.metrics, config.signals, clock,
                                              headers=inject)
            self.relay.pd = PDForwarder(self.relay, self.decode_pool, pd, dp_size=dp_size)
            self.membership.on_disaggregation = self._reload_disaggregation
        self.housekeeping = Housekeeping(self.engine, self.membership, self.affinity, self.metrics,
                                         config.routing, clock)
        self.handlers = Handlers(config, self.registry, self.relay, self.metrics, clock,
                                 exact_blocks=self._exact_blocks, tokenize_pool=self.tokenize_pool,
                                 pd_pollers=(self.poller, self.decode_poller)
                                 if self.decode_poller is not None else None)

    @property
    def config(self) -> RouterConfig:
        """The running config (a reload updates its policy and replicas)."""
        return self.membership.config

    @property
    def policy(self) -> Policy:
        return self.engine.policy

    @property
    def shutting_down(self) -> bool:
        return self.handlers.shutting_down

    def stop_accepting(self) -> None:
        """SIGTERM: /ready answers 503 and new requests get 503 from now on."""
        self.handlers.stop_accepting()

    def _make_affinity_store(self) -> AffinityStore:
        a = self.config.affinity
        if a.store == "memory":
            return MemoryAffinityStore(self.table, self.clock)
        log.info("affinity store: redis %s prefix %r", redact_url(a.redis_url), a.key_prefix)
        return RedisAffinityStore(
            self.table, a.redis_url, key_prefix=a.key_prefix, ttl_s=a.ttl_s, lease_s=a.lease_s,
            op_timeout_s=a.op_timeout_s, retry_after_s=a.retry_after_s, clock=self.clock,
            on_error=lambda op: self.metrics.affinity_errors.labels(op).inc(),
            password=os.environ.get(a.password_env) if a.password_env else None,
            max_sessions=a.max_sessions, buckets=a.redis_buckets, cluster=a.redis_cluster,
            on_evict=self.metrics.sessions_evicted.labels("redis").inc, metrics=self.metrics,
        )

    @staticmethod
    def _make_tracing(config: RouterConfig) -> Tracing | None:
        obs = config.observability
        if not tracing_wanted(obs):
            return None
        try:
            return Tracing(obs)
        except TracingUnavailable as err:
            if obs.otel_endpoint:  # asked for in the config: a start-up error naming the key
                raise ConfigError(f"observability.otel_endpoint: {err}") from None
            log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but %s; running without tracing", err)
            return None

    def _reload_disaggregation(self, pd: DisaggregationConfig) -> list[str]:
        """SIGHUP or the admin reload on a PD fleet: the decode list and the prefill servers'
        bootstrap ports (the prefill list itself is the replica list)."""
        assert self.decode_pool is not None and self.relay.pd is not None
        self.relay.pd.config = pd
        return self.decode_pool.set_urls(pd.decode)

    def _make_peer_share(self) -> PeerShare | None:
        """Share the shadow index and the session table with the other routers on the affinity
        store's Redis, if asked."""
        a = self.config.affinity
        if a.store != "redis" or not a.share_routing_state:
            return None
        # The exact index follows the replicas' own KV events in every router: nothing to share.
        index = self.index if isinstance(self.index, ShadowKVIndex) else None
        share = PeerShare(
            a.redis_url, share_channel(a.key_prefix, self.config.routing.block_chars),
            index=index, table=self.table, known=self.registry.__contains__, clock=self.clock,
            op_timeout_s=a.op_timeout_s, metrics=self.metrics,
            password=os.environ.get(a.password_env) if a.password_env else None,
            registry=self.registry if a.share_in_flight else None,
        )
        if index is not None:
            self.engine.on_record = share.recorded
        self.engine.on_home = share.homed
        return share

    def _on_signals(self, url: str, signals: ReplicaSignals) -> None:
        if signals.max_total_num_tokens:
            self.index.set_capacity(url, signals.max_total_num_tokens)
        if signals.num_running_reqs is not None:
            self.metrics.polled_running.labels(url).set(signals.num_running_reqs)
        if signals.num_queue_reqs is not None:
            self.metrics.polled_queued.labels(url).set(signals.num_queue_reqs)
        if signals.token_usage is not None:
            self.metrics.polled_token_usage.labels(url).set(signals.token_usage)
        if self.relay.admission is not None:  # a slot may have freed: re-decide waiting requests
            self.relay.admission.wake()

    # -- application --------------------------------------------------------------------------
    def build_server(self) -> DataServer:
        """The data port's server (router/data_server.py): its routes, middlewares and the
        lifecycle that starts and stops the router's parts."""
        server = self.config.server
        middlewares: list[Middleware] = [errors_middleware(server.max_body_bytes)]
        if self.api_keys:  # only when client keys are configured (they are read once, at start)
            middlewares.append(auth_middleware(self.api_keys, self.key_limiter, self.config.auth,
                                               self.metrics))
        h = self.handlers
        routes: dict[str, dict[str, Handler]] = {route: {"POST": h.handle_inference}
                                                 for route in INFERENCE_ROUTES}
        routes["/v1/models"] = {"GET": h.handle_models}
        routes["/health"] = {"GET": h.handle_health}
        routes["/ready"] = {"GET": h.handle_ready}
        routes["/metrics"] = {"GET": h.handle_metrics}
        pd = None
        if self.decode_pool is not None and self.relay.pd is not None:
            pd = DiscoveredPDFleet(self.decode_pool, self.relay.pd.discovered_ports)
        # Discovery after the lifecycle, so it stops first.
        lifecycles = [self._lifecycle, discovery_ctx(self.config.discovery, self.membership, self.metrics, pd)]
        return DataServer(routes, middlewares, lifecycles, max_body_bytes=server.max_body_bytes,
                          header_timeout_s=server.client_header_timeout_s,
                          shutdown_grace_s=server.shutdown_grace_s)

    async def _lifecycle(self, server: object) -> AsyncIterator[None]:
        # Each part is stopped by the exit stack, last registered first: every stop runs even
        # when one before it raises, and a start that fails stops what had started.
        async with contextlib.AsyncExitStack() as stops:
            if self.tracing is not None:
                stops.push_async_callback(asyncio.to_thread, self.tracing.shutdown)  # exports what is buffered
            if self.decision_log is not None:  # flushes, joins its writer thread
                stops.push_async_callback(asyncio.to_thread, self.decision_log.close)
            if self.tokenize_pool is not None:
                stops.callback(self.tokenize_pool.close)
            decode_poller = self.decode_poller
            if decode_poller is not None:
                stops.push_async_callback(decode_poller.aclose)
            stops.push_async_callback(self.poller.aclose)
            await self.relay.start()
            stops.push_async_callback(self.relay.close)
            await self.affinity.start()
            stops.push_async_callback(self.affinity.close)
            tasks = [  # a crash restarts the loop (logged, counted), never silently ends it
                spawn("signal-poller", self.poller.run, metrics=self.metrics),
                spawn("housekeeping", self.housekeeping.run, metrics=self.metrics),
            ]
            if decode_poller is not None:
                tasks.append(spawn("decode-poller", decode_poller.run, metrics=self.metrics))
            stops.push_async_callback(_cancel_and_wait, tasks)
            if self.kv_events is not None:
                self.kv_events.start(self.registry.urls())
                stops.push_async_callback(self.kv_events.close)
            if self.peer_share is not None:
                self.peer_share.start(functools.partial(spawn, metrics=self.metrics))
                stops.push_async_callback(self.peer_share.close)
            yield

