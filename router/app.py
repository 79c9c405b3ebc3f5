"""The router process: aiohttp handlers that parse just enough, ask the policy, and relay."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from ..metrics.router_metrics import RouterMetrics
from ..metrics.sglang import ReplicaSignals
from ..policies.base import Policy, RequestSummary
from ..policies.registry import build_policy
from .affinity import AffinityStore, MemoryAffinityStore, RedisAffinityStore
from .config import RouterConfig, normalize_replica_url
from .discovery import discovery_ctx
from .engine import RoutingEngine
from .errors import error_response
from .headers import REQUEST_ID, request_id_from
from .kv_events_index import ExactKVIndex, request_blocks
from .kv_events_subscriber import KVEventSubscriber
from .kv_index import KVIndex, ShadowKVIndex
from .poller import SignalPoller
from .relay import Relay
from .security import KeyLimiter, bearer_token, constant_time_in, load_api_keys, redact_url
from .replicas import ReplicaRegistry
from .sessions import SessionTable
from .summary import ExactBlocks, summarize
from .supervise import spawn
from .tokenizers import TokenizePool, load_tokenizer

log = logging.getLogger("kvrouter")

INFERENCE_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
OPEN_ROUTES = frozenset({"/health", "/ready", "/metrics"})  # never behind client API keys
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
        worker: int | None = None,
    ) -> None:
        self.config = config
        self.worker = worker  # index under `serve --workers N`, else None
        self.clock = clock
        self.metrics = RouterMetrics()
        self.registry = ReplicaRegistry(config.replicas, config.signals.failure_threshold)
        self.policy = policy or build_policy(config.policy.name, config.policy.params)
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
        self.engine = RoutingEngine(
            self.policy, self.registry, self.index, self.table, rng or random.Random(),
            metrics=self.metrics,
        )
        self.affinity = self._make_affinity_store()
        self.shutting_down = False  # SIGTERM: /ready 503 and no new requests
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
        log.info("affinity store: redis %s prefix %r", redact_url(a.redis_url), a.key_prefix)
        return RedisAffinityStore(
            self.table, a.redis_url, key_prefix=a.key_prefix, ttl_s=a.ttl_s, lease_s=a.lease_s,
            op_timeout_s=a.op_timeout_s, retry_after_s=a.retry_after_s, clock=self.clock,
            on_error=lambda op: self.metrics.affinity_errors.labels(op).inc(),
            password=os.environ.get(a.password_env) if a.password_env else None,
            max_sessions=a.max_sessions, buckets=a.redis_buckets, cluster=a.redis_cluster,
            on_evict=self.metrics.sessions_evicted.labels("redis").inc,
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
        self.metrics.forget_replica(url)  # every series labelled with it
        self.relay.pool.forget_replica(url)  # its idle connections and parsed URL
        return True

    def drain(self, url: str) -> bool:
        """No new requests to `url`; it is removed once its in-flight requests have finished."""
        if not self.registry.drain(url):
            return False
        self.metrics.replica_healthy.labels(url).set(0)
        log.info("replica %s draining", url)
        return True

    def remove_drained(self) -> list[str]:
        done = [u for u in list(self.registry.draining)
                if (v := self.registry.view(u)) is not None and v.in_flight == 0]
        for url in done:
            self.remove_replica(url)
            log.info("replica %s drained and removed", url)
        return done

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
            self.remove_drained()
            self.engine.settle_fresh()
            _, max_over_mean, cv = self.engine.load_stats()
            self.metrics.load_max_over_mean.set(max_over_mean)
            self.metrics.load_cv.set(cv)
            self.metrics.sessions.set(len(self.table))
            self.metrics.affinity_degraded.set(1 if self.affinity.degraded else 0)
            if now - last_rebalance >= routing.rebalance_interval_s:
                last_rebalance = now
                for move in self.engine.plan_rebalance(
                    now, routing.rebalance_interval_s, routing.rebalance_max_moves,
                    kv_pressure=routing.rebalance_kv_pressure,
                ):
                    await self.affinity.move(move.session, move.target)
                    self.metrics.rebalanced.inc()

    # -- application --------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        # The auth middleware only when client keys are configured (they are read once, at start).
        middlewares = [self._errors_middleware] + ([self._auth_middleware] if self.api_keys else [])
        app = web.Application(
            client_max_size=self.config.server.max_body_bytes, middlewares=middlewares,
        )
        expect = {"expect_handler": self._expect}
        for route in INFERENCE_ROUTES:
            app.router.add_post(route, self.handle_inference, **expect)
        app.router.add_get("/v1/models", self.handle_models, **expect)
        app.router.add_get("/health", self.handle_health, **expect)
        app.router.add_get("/ready", self.handle_ready, **expect)
        app.router.add_get("/metrics", self.handle_metrics, **expect)
        # Last: unknown paths and methods get their 404/405 here, inside the middlewares, and
        # with our Expect handler (aiohttp's own runs before middlewares and can fail with 500).
        app.router.add_route("*", "/{tail:.*}", self.handle_unrouted, **expect)
        app.cleanup_ctx.append(self._lifecycle)
        app.cleanup_ctx.append(discovery_ctx(self))  # after _lifecycle: stops first
        return app

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        await self.relay.start()
        await self.affinity.start()
        assert self.relay.session is not None
        session = self.relay.session
        tasks = [  # a crash restarts the loop (logged, counted), never silently ends it
            spawn("signal-poller", lambda: self.poller.run(session), metrics=self.metrics),
            spawn("housekeeping", self.housekeeping, metrics=self.metrics),
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
        if self.tokenize_pool is not None:
            self.tokenize_pool.close()

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
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return error_response(
                exc.status, message, kinds.get(exc.status, "invalid_request_error"), allow
            )
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:  # a bug must still answer in the API's shape, and never kill the loop
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(500, "internal router error", "internal_error")

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Client API keys (when configured): constant-time check, then a per-key in-flight limit."""
        if not self.api_keys or request.path in OPEN_ROUTES:
            return await handler(request)
        token = bearer_token(request.headers)
        key = constant_time_in(token, self.api_keys) if token is not None else None
        if key is None:
            self.metrics.auth_rejections.labels("invalid_key").inc()
            return error_response(401, "invalid or missing API key", "invalid_request_error",
                                  {"WWW-Authenticate": "Bearer"})
        if request.path not in INFERENCE_ROUTES:
            return await handler(request)
        if not self.key_limiter.acquire(key):
            self.metrics.auth_rejections.labels("key_concurrency").inc()
            retry = str(self.config.auth.retry_after_s)
            return error_response(
                429, f"too many concurrent requests for this API key "
                f"(limit {self.config.auth.max_concurrent_per_key})",
                "rate_limit_error", {"Retry-After": retry},
            )
        try:
            return await handler(request)
        finally:
            self.key_limiter.release(key)

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
            m = self.metrics
            m.child(m.requests, route, str(status)).inc()
            m.child(m.duration, route).observe(self.clock() - started)

    async def _inference(
        self, request: web.Request, route: str, request_id: str
    ) -> web.StreamResponse:
        rid_header = {REQUEST_ID: request_id}
        if self.shutting_down:
            return error_response(503, "router is shutting down", "service_unavailable",
                                  {**rid_header, "Retry-After": "1", "Connection": "close"})
        try:
            if request.content.is_eof():  # the whole body came with the headers: no timer needed
                body = await request.read()  # 413 (via middleware) above max_body_bytes
            else:
                async with asyncio.timeout(self.config.server.client_body_timeout_s):
                    body = await request.read()
        except TimeoutError:
            return error_response(408, "request body not received in time", "invalid_request_error",
                                  {**rid_header, "Connection": "close"})
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError as err:
            return error_response(400, f"invalid JSON body: {err}", "invalid_request_error", rid_header)
        if not isinstance(parsed, dict):
            return error_response(
                400, "request body must be a JSON object", "invalid_request_error", rid_header
            )
        target = None
        routing = self.config.routing
        body_hint = None
        if routing.target_hint_field in parsed:  # a router-only field: never forwarded, honoured or not
            body_hint = parsed.pop(routing.target_hint_field)
            try:
                body = orjson.dumps(parsed)
            except orjson.JSONEncodeError:  # orjson writes at most 254 levels of nesting
                return error_response(400, "request body nested too deeply", "invalid_request_error",
                                      rid_header)
        if routing.allow_target_hint:
            hint = request.headers.get(routing.target_hint_header)
            if hint is None:
                hint = body_hint
            if hint is not None:
                target = self._known_replica(hint)
                if target is None:  # never an outbound request to a URL a client made up
                    return error_response(400, "target worker is not a known replica",
                                          "invalid_request_error", rid_header)
                if not self.registry.healthy(target):
                    return error_response(503, "target worker is not available", "service_unavailable",
                                          {**rid_header, "Retry-After": "1"})
        summary = await self.summarize_request(route, parsed, request.headers)
        return await self.relay.forward(request, body, summary, request_id, target)

    async def summarize_request(
        self, route: str, parsed: dict[str, Any], headers: Mapping[str, str]
    ) -> RequestSummary:
        """What the policy needs of a request; with the exact KV index, its block hashes are
        computed in the tokenizer pool (None there, or a full pool: no exact match)."""
        exact = self._exact_blocks
        if self.tokenize_pool is not None:
            found = await self.tokenize_pool.run(route, parsed)
            exact = lambda _route, _body: found  # noqa: E731
        return summarize(route, parsed, headers, self.config.routing, exact)

    def _known_replica(self, hint: object) -> str | None:
        if not isinstance(hint, str) or len(hint) > 2048:
            return None
        try:
            url = normalize_replica_url(hint)
        except (ValueError, TypeError):
            return None
        return url if url in self.registry else None

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

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` is honoured; any other expectation is a JSON 417."""
        if request.headers.get("Expect", "").lower() == "100-continue":
            if request.version >= (1, 1):
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0
            return None
        return error_response(417, "unsupported Expect header (only 100-continue)",
                              "invalid_request_error", {"Connection": "close"})

    async def handle_unrouted(self, request: web.Request) -> web.StreamResponse:
        allowed = sorted({
            r.method for r in request.app.router.routes()
            if r.method != "*" and r.resource is not None and r.resource.canonical == request.path
        })
        if allowed:
            raise web.HTTPMethodNotAllowed(request.method, allowed)
        raise web.HTTPNotFound()

    async def handle_health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def handle_ready(self, request: web.Request) -> web.StreamResponse:
        healthy = sum(1 for v in self.registry.snapshot().replicas if v.healthy)
        ready = healthy > 0 and not self.shutting_down
        body = orjson.dumps({"ready": ready, "healthy_replicas": healthy,
                             "replicas": len(self.registry), "shutting_down": self.shutting_down})
        return web.Response(status=200 if ready else 503, body=body,
                            content_type="application/json")

    async def handle_metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": self.metrics.content_type})
