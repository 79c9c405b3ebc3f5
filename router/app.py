"""The router process: aiohttp handlers that parse just enough, ask the policy, and relay."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from ..metrics.router_metrics import RouterMetrics
from ..policies.base import Policy
from ..policies.registry import build_policy
from .config import RouterConfig
from .errors import error_response
from .headers import REQUEST_ID, request_id_from
from .health import HealthProber
from .relay import Relay
from .replicas import ReplicaRegistry
from .summary import summarize

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
        self.registry = ReplicaRegistry(config.replicas, config.health.failure_threshold)
        self.policy = policy or build_policy(config.policy.name, config.policy.params)
        self.relay = Relay(
            self.registry, self.policy, self.metrics, config.upstream, rng or random.Random(), clock
        )
        self.prober = HealthProber(self.registry, self.metrics, config.health)
        for url in self.registry.urls():
            self.metrics.replica_healthy.labels(url).set(1)
            self.metrics.in_flight.labels(url).set(0)

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
        assert self.relay.session is not None
        prober = asyncio.create_task(self.prober.run(self.relay.session), name="health-prober")
        yield
        prober.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await prober
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
        return await self.relay.forward(request, body, summarize(route, parsed), request_id)

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
