"""The data port's middlewares (router/data_server.py runs each request's handler inside them):
OpenAI-shaped errors, and client API keys."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from ..metrics.router_metrics import RouterMetrics
from .config import AuthConfig
from .data_http import Answer, Request
from .errors import error_response
from .security import KeyLimiter, bearer_token, constant_time_in

log = logging.getLogger("kvrouter")

INFERENCE_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
OPEN_ROUTES = frozenset({"/health", "/ready", "/metrics"})  # never behind client API keys
Handler = Callable[[Request], Awaitable[Answer]]
Middleware = Callable[[Request, Handler], Awaitable[Answer]]


def errors_middleware(max_body_bytes: int) -> Middleware:
    """Every error the router itself produces is an OpenAI-shaped JSON body."""

    async def errors(request: Request, handler: Handler) -> Answer:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kinds = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
            message = exc.reason if exc.status != 413 else (
                f"request body exceeds {max_body_bytes} bytes"
            )
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return error_response(
                exc.status, message, kinds.get(exc.status, "invalid_request_error"), allow
            )
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except orjson.JSONEncodeError:
            # The router writes JSON back only from the client's body (its prompt's content parts,
            # a field it adds or removes), and orjson reads deeper nesting than it writes (254).
            return error_response(400, "request body nested too deeply (at most 254 levels)",
                                  "invalid_request_error")
        except Exception:  # a bug must still answer in the API's shape, and never kill the loop
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(500, "internal router error", "internal_error")

    return errors


def auth_middleware(
    api_keys: tuple[bytes, ...], limiter: KeyLimiter, auth: AuthConfig, metrics: RouterMetrics
) -> Middleware:
    """Client API keys: constant-time check, then a per-key in-flight limit on inference routes.
    Installed only when keys are configured (they are read once, at start)."""

    async def authenticate(request: Request, handler: Handler) -> Answer:
        if not api_keys or request.path in OPEN_ROUTES:
            return await handler(request)
        token = bearer_token(request.headers)
        key = constant_time_in(token, api_keys) if token is not None else None
        if key is None:
            metrics.auth_rejections.labels("invalid_key").inc()
            return error_response(401, "invalid or missing API key", "invalid_request_error",
                                  {"WWW-Authenticate": "Bearer"})
        if request.path not in INFERENCE_ROUTES:
            return await handler(request)
        if not limiter.acquire(key):
            metrics.auth_rejections.labels("key_concurrency").inc()
            return error_response(
                429, f"too many concurrent requests for this API key "
                f"(limit {auth.max_concurrent_per_key})",
                "rate_limit_error", {"Retry-After": str(auth.retry_after_s)},
            )
        try:
            return await handler(request)
        finally:
            limiter.release(key)

    return authenticate
