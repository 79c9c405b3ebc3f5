"""The data port's request handlers: inference (parse just enough, summarize, relay), the
merged /v1/models, health, readiness and metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from ..metrics.router_metrics import RouterMetrics
from ..policies.domain import RequestSummary
from .body_prefixes import BodyPrefixes
from .config import RouterConfig, normalize_replica_url
from .data_http import Answer, Request
from .errors import error_response
from .headers import REQUEST_ID, request_id_from
from .poller import SignalPoller
from .relay import Relay
from .replicas import ReplicaRegistry
from .prefix import session_key
from .prefix_chain import PrefixChains
from .summary import BYTES_PER_TOKEN, ExactBlocks, summarize
from .usage import body_asking_stream_usage
from .tokenizers import TokenizePool

CHAT_ROUTE = "/v1/chat/completions"


class Handlers:
    """The routes' handlers, over the parts the composition root built. `shutting_down` (set by
    `stop_accepting`) turns new inference requests away and /ready to 503."""

    def __init__(
        self,
        config: RouterConfig,
        registry: ReplicaRegistry,
        relay: Relay,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        *,
        exact_blocks: ExactBlocks | None = None,
        tokenize_pool: TokenizePool[tuple[int, tuple[int, ...]]] | None = None,
        pd_pollers: tuple[SignalPoller, SignalPoller] | None = None,
    ) -> None:
        self.config = config  # server and routing settings: a reload does not change them
        self.registry = registry
        self.relay = relay
        self.metrics = metrics
        self.clock = clock
        self._exact_blocks = exact_blocks
        self.tokenize_pool = tokenize_pool
        self.prefix_chains = PrefixChains(int(config.routing.prefix_chain_cache_mb * 2**20))
        self.chat_bodies = BodyPrefixes(int(config.routing.prefix_chain_cache_mb * 2**20))
        # PD disaggregation: the (prefill, decode) pollers; /ready needs a member of each pool
        # that is healthy and has answered a poll
        self.pd_pollers = pd_pollers
        self.shutting_down = False

    def stop_accepting(self) -> None:
        """SIGTERM: /ready answers 503 and new inference requests get 503 from now on."""
        self.shutting_down = True

    async def handle_inference(self, request: Request) -> Answer:
        started = self.clock()
        route = request.path
        request_id = request_id_from(request.headers)
        status = 499  # client closed request, unless we get further
        try:
            response = await self._inference(request, route, request_id, started)
            status = response.status
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.count(self.metrics.client_disconnects)
            raise
        finally:
            m = self.metrics
            m.count(m.requests, (route, str(status)))
            m.observe(m.duration, (route,), self.clock() - started)

    async def _inference(
        self, request: Request, route: str, request_id: str, received: float
    ) -> Answer:
        rid_header = {REQUEST_ID: request_id}
        if self.shutting_down:
            return error_response(503, "router is shutting down", "service_unavailable",
                                  {**rid_header, "Retry-After": "1", "Connection": "close"})
        body = request.body_now()  # the whole body came with the headers: no timer, no await
        if body is None:
            try:
                if request.content.is_eof():  # (too large or malformed: read raises it)
                    body = await request.read()
                else:
                    async with asyncio.timeout(self.config.server.client_body_timeout_s):
                        body = await request.read()
            except TimeoutError:
                return error_response(408, "request body not received in time", "invalid_request_error",
                                      {**rid_header, "Connection": "close"})
        try:
            if route == CHAT_ROUTE:  # an agent's next turn: only its new bytes are parsed
                parsed = self.chat_bodies.loads(body, self._header_session(request.headers))
            else:
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
        ticket = None
        gate = self.relay.admission
        if gate is not None and gate.active and target is None:
            ticket = gate.ticket(request.headers, parsed)
            field = gate.config.priority_field
            if field is not None and isinstance(parsed.get(field), str):
                parsed.pop(field)  # a class name is the router's; SGLang's own priority is an int
                body = orjson.dumps(parsed)
        asked = body_asking_stream_usage(route, parsed, body) \
            if self.config.learning.inject_stream_usage else None
        drop_usage = asked is not None
        if asked is not None:
            body = asked
        if self.tokenize_pool is None:  # nothing to await
            summary, text_bytes = self._summarize_now(route, parsed, request.headers, self._exact_blocks)
        else:
            summary, text_bytes = await self._summarize(route, parsed, request.headers)
        return await self.relay.forward(request, body, summary, request_id, target,
                                        prompt_bytes=text_bytes, drop_usage=drop_usage, ticket=ticket,
                                        received=received)

    async def summarize_request(
        self, route: str, parsed: dict[str, Any], headers: Mapping[str, str]
    ) -> RequestSummary:
        """What the policy needs of a request; with the exact KV index, its block hashes are
        computed in the tokenizer pool (None there, or a full pool: no exact match)."""
        return (await self._summarize(route, parsed, headers))[0]

    async def _summarize(
        self, route: str, parsed: dict[str, Any], headers: Mapping[str, str]
    ) -> tuple[RequestSummary, int]:
        exact = self._exact_blocks
        if self.tokenize_pool is not None:
            found = await self.tokenize_pool.run(route, parsed)
            exact = lambda _route, _body: found  # noqa: E731
        return self._summarize_now(route, parsed, headers, exact)

    def _summarize_now(self, route: str, parsed: dict[str, Any], headers: Mapping[str, str],
                       exact: ExactBlocks | None) -> tuple[RequestSummary, int]:
        learner = self.relay.engine.learner
        model = parsed.get("model")
        bytes_per_token = BYTES_PER_TOKEN if learner is None else learner.bytes_per_token(
            model if isinstance(model, str) else None)
        return summarize(route, parsed, headers, self.config.routing, exact, bytes_per_token,
                         self.prefix_chains)

    def _header_session(self, headers: Mapping[str, str]) -> str | None:
        """The session key a request's headers give (its body's fields are not parsed yet)."""
        return session_key(headers, {}, self.config.routing.session_headers, ())

    def _known_replica(self, hint: object) -> str | None:
        if not isinstance(hint, str) or len(hint) > 2048:
            return None
        try:
            url = normalize_replica_url(hint)
        except (ValueError, TypeError):
            return None
        return url if url in self.registry else None

    async def handle_models(self, request: Request) -> Answer:
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

    async def handle_health(self, request: Request) -> Answer:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def handle_ready(self, request: Request) -> Answer:
        healthy = sum(1 for v in self.registry.snapshot().replicas if v.healthy)
        ready = healthy > 0 and not self.shutting_down
        state: dict[str, Any] = {"healthy_replicas": healthy, "replicas": len(self.registry),
                                 "shutting_down": self.shutting_down}
        if self.pd_pollers is not None:
            prefill, decode = self.pd_pollers
            state["prefill_servers_up"] = prefill.up_count()
            state["decode_servers_up"] = decode.up_count()
            state["decode_servers"] = len(decode.registry)
            ready = ready and state["prefill_servers_up"] > 0 and state["decode_servers_up"] > 0
        body = orjson.dumps({"ready": ready, **state})
        return web.Response(status=200 if ready else 503, body=body,
                            content_type="application/json")

    async def handle_metrics(self, request: Request) -> Answer:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": self.metrics.content_type})
