"""The router process: aiohttp handlers that parse just enough, ask the policy, and relay."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from ..metrics.router_metrics import RouterMetrics
from ..metrics.sglang import ReplicaSignals
from ..policies.base import Policy
from ..policies.registry import build_policy
from .affinity import AffinityStore, MemoryAffinityStore, RedisAffinityStore
from .config import RouterConfig
from .engine import RoutingEngine
from .errors import error_response
from .headers import REQUEST_ID, request_id_from
from .kv_events_index import ExactKVIndex, request_blocks
from .kv_events_subscriber import KVEventSubscriber
from .kv_index import KVIndex, ShadowKVIndex
from .poller import SignalPoller
from .relay import Relay
from .replicas import ReplicaRegistry
from .sessions import SessionTable
from .summary import ExactBlocks, summarize
from .tokenizers import load_tokenizer

log = logging.getLogger("kvrouter")

INFERENCE_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Router:
    """Owns the replica registry, the policy, the relay and the background loops."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        policy: Policy | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = RouterMetrics()
        self.registry = ReplicaRegistry(config.replicas, config.signals.failure_threshold)
        self.policy = policy or build_policy(config.policy.name, config.policy.params)
        self.index: KVIndex
        self.kv_events: KVEventSubscriber | None = None
        self._exact_blocks: ExactBlocks | None = None
        kv = config.kv_events
        if kv.enabled:
            self.index = exact = ExactKVIndex(kv.page_size)
            self.kv_events = KVEventSubscriber(exact, kv, self.metrics)
            self._exact_blocks = functools.partial(
                request_blocks, load_tokenizer(kv.tokenizer), page_size=kv.page_size
            )
        else:
            self.index = ShadowKVIndex(block_tokens=max(1, config.routing.block_chars // 4))
        self.table = SessionTable(config.routing.session_ttl_s)
        self.engine = RoutingEngine(
            self.policy, self.registry, self.index, self.table, rng or random.Random()
        )
        self.table._on_change = self.engine.sync_homed
        self.affinity = self._make_affinity_store()
        self.relay = Relay(self.engine, self.affinity, self.metrics, config.upstream, clock,
                           replica_header=config.server.replica_header)
        self.poller = SignalPoller(
            self.registry, self.metrics, config.signals, clock, on_signals=self._on_signals
        )
        for url in self.registry.urls():
            self.metrics.replica_healthy.labels(url).set(1)
            self.metrics.in_flight.labels(url).set(0)

    def _make_affinity_store(self) -> AffinityStore:
        a = self.config.affinity
        if a.store == "memory":
            return MemoryAffinityStore(self.table, self.clock)
        return RedisAffinityStore(
            self.table, a.redis_url, key_prefix=a.key_prefix, ttl_s=a.ttl_s, lease_s=a.lease_s,
            op_timeout_s=a.op_timeout_s, retry_after_s=a.retry_after_s, clock=self.clock,
            on_error=lambda op: self.metrics.affinity_errors.labels(op).inc(),
        )

    def _on_signals(self, url: str, signals: ReplicaSignals) -> None:
        if signals.max_total_num_tokens:
            self.index.set_capacity(url, signals.max_total_num_tokens)
        if signals.num_running_reqs is not None:
            self.metrics.polled_running.labels(url).set(signals.num_running_reqs)
        if signals.num_queue_reqs is not None:
            self.metrics.polled_queued.labels(url).set(signals.num_queue_reqs)
        if signals.token_usage is not None:
            self.metrics.polled_token_usage.labels(url).set(signals.token_usage)

    # -- replicas at run time (admin API, discovery) ---------------------------------------------
    def add_replica(self, url: str) -> bool:
        added = self.engine.add_replica(url, self.clock())
        if added:
            self.metrics.replica_healthy.labels(url).set(1)
            self.metrics.in_flight.labels(url).set(0)
            if self.kv_events is not None:
                self.kv_events.add(url)
        return added

    def remove_replica(self, url: str) -> bool:
        if url not in self.registry:
            return False
        self.engine.remove_replica(url)
        if self.kv_events is not None:
            self.kv_events.remove(url)
        self.metrics.forget_replica(url)
        return True

    def reload(self, config: RouterConfig) -> list[str]:
        """Apply a new config without dropping requests: the policy is swapped between two
        decisions and replicas are added (fresh) or removed (in-flight requests finish).
        Server, upstream and store settings need a restart. Returns what changed."""
        changes = []
        if config.policy != self.config.policy:
            self.policy = build_policy(config.policy.name, config.policy.params)
            self.engine.policy = self.policy
            changes.append(f"policy -> {config.policy.name}")
        for url in config.replicas:
            if self.add_replica(url):
                changes.append(f"+{url}")
        for url in set(self.config.replicas) - set(config.replicas):
            if self.remove_replica(url):
                changes.append(f"-{url}")
        self.config = self.config.model_copy(
            update={"policy": config.policy, "replicas": config.replicas}
        )
        return changes

    async def housekeeping(self) -> None:
        """Once a second: forget idle sessions, settle fresh replicas, export load balance;
        every rebalance interval, move a few idle sessions onto fresh replicas."""
        routing = self.config.routing
        last_rebalance = self.clock()
        while True:
            await asyncio.sleep(1.0)
            now = self.clock()
            self.table.expire(now)
            self.engine.settle_fresh()
            _, max_over_mean, cv = self.engine.load_stats()
            self.metrics.load_max_over_mean.set(max_over_mean)
            self.metrics.load_cv.set(cv)
            self.metrics.sessions.set(len(self.table))
            self.metrics.affinity_degraded.set(1 if self.affinity.degraded else 0)
            if now - last_rebalance >= routing.rebalance_interval_s:
                last_rebalance = now
                for move in self.engine.plan_rebalance(
                    now, routing.rebalance_interval_s, routing.rebalance_max_moves
                ):
                    await self.affinity.move(move.session, move.target)
                    self.metrics.rebalanced.inc()

    # -- application --------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.server.max_body_bytes,
            middlewares=[self._errors_middleware],
        )
        for route in INFERENCE_ROUTES:
            app.router.add_post(route, self.handle_inference)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/ready", self.handle_ready)
        app.router.add_get("/metrics", self.handle_metrics)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        await self.relay.start()
        await self.affinity.start()
        assert self.relay.session is not None
        tasks = [
            asyncio.create_task(self.poller.run(self.relay.session), name="signal-poller"),
            asyncio.create_task(self.housekeeping(), name="housekeeping"),
        ]
        if self.kv_events is not None:
            self.kv_events.start(self.registry.urls())
        yield
        if self.kv_events is not None:
            await self.kv_events.close()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.affinity.close()
        await self.relay.close()

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error the router itself produces is an OpenAI-shaped JSON body."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kinds = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
            message = exc.reason if exc.status != 413 else (
                f"request body exceeds {self.config.server.max_body_bytes} bytes"
            )
            return error_response(
                exc.status, message, kinds.get(exc.status, "invalid_request_error")
            )

    # -- handlers -------------------------------------------------------------------------------
    async def handle_inference(self, request: web.Request) -> web.StreamResponse:
        started = self.clock()
        route = request.path
        request_id = request_id_from(request.headers)
        status = 499  # client closed request, unless we get further
        try:
            response = await self._inference(request, route, request_id)
            status = response.status
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.client_disconnects.inc()
            raise
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.duration.labels(route).observe(self.clock() - started)

    async def _inference(
        self, request: web.Request, route: str, request_id: str
    ) -> web.StreamResponse:
        rid_header = {REQUEST_ID: request_id}
        body = await request.read()  # 413 (via middleware) above max_body_bytes
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError as err:
            return error_response(400, f"invalid JSON body: {err}", "invalid_request_error", rid_header)
        if not isinstance(parsed, dict):
            return error_response(
                400, "request body must be a JSON object", "invalid_request_error", rid_header
            )
        summary = summarize(route, parsed, request.headers, self.config.routing, self._exact_blocks)
        return await self.relay.forward(request, body, summary, request_id)

    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        """The union of every healthy replica's /v1/models, queried concurrently."""
        assert self.relay.session is not None
        session = self.relay.session
        urls = [v.id for v in self.registry.snapshot().replicas if v.healthy]

        async def fetch(url: str) -> list[dict[str, object]]:
            try:
                async with session.get(
                    url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)
                ) as resp:
                    if resp.status != 200:
                        return []
                    data = orjson.loads(await resp.read()).get("data", [])
                    return [m for m in data if isinstance(m, dict) and "id" in m]
            except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, AttributeError):
                return []

        merged: dict[str, dict[str, object]] = {}
        for models in await asyncio.gather(*(fetch(u) for u in urls)):
            for model in models:
                merged.setdefault(str(model["id"]), model)
        if not merged and urls:
            return error_response(502, "no replica answered /v1/models", "upstream_error")
        if not urls:
            return error_response(503, "no healthy replica", "service_unavailable",
                                  {"Retry-After": "1"})
        return web.Response(
            body=orjson.dumps({"object": "list", "data": list(merged.values())}),
            content_type="application/json",
        )

    async def handle_health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def handle_ready(self, request: web.Request) -> web.StreamResponse:
        healthy = sum(1 for v in self.registry.snapshot().replicas if v.healthy)
        body = orjson.dumps({"ready": healthy > 0, "healthy_replicas": healthy,
                             "replicas": len(self.registry)})
        return web.Response(status=200 if healthy else 503, body=body,
                            content_type="application/json")

    async def handle_metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": self.metrics.content_type})
