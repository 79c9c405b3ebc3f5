"""The admin API, on its own port (default 127.0.0.1:8001), behind a bearer token from the environment.

    GET    /admin/replicas              every replica and its live view
    POST   /admin/replicas        {url} add (fresh: preferred for new sessions)
    DELETE /admin/replicas?url=URL      remove (its in-flight requests finish)
    POST   /admin/replicas/drain  {url} no new requests; removed once its in-flight ones end
    POST   /admin/reload                re-read the config file (as SIGHUP does)
    GET    /admin/state                 sessions, per-replica views, policy, flags

Disabled unless the token variable (`admin.token_env`, default KVROUTER_ADMIN_TOKEN) is set and
non-empty. The token is compared in constant time and never logged. None of these routes exist on
the data port.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from .app import Router
from .config import AdminConfig, ConfigError, RouterConfig, normalize_replica_url
from .errors import error_response
from .http_errors import JSONErrorAppRunner
from .membership import ReplicaMembership
from .security import bearer_token

log = logging.getLogger("kvrouter.admin")

Reader = Callable[[], RouterConfig]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def admin_token(config: AdminConfig, environ: dict[str, str] | None = None) -> str | None:
    """The admin token, or None when the admin API is off."""
    if not config.enabled:
        return None
    token = (os.environ if environ is None else environ).get(config.token_env, "")
    return token or None


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


class AdminAPI:
    def __init__(self, router: Router, token: str, reader: Reader | None = None) -> None:
        if not token:
            raise ValueError("the admin API needs a token")
        self.router = router  # read-only here: its registry, sessions and flags for the views
        self.membership: ReplicaMembership = router.membership  # every change goes through it
        self._token = token.encode()
        self.reader = reader

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024, middlewares=[self._middleware])
        app.router.add_get("/admin/replicas", self.list_replicas)
        app.router.add_post("/admin/replicas", self.add_replica)
        app.router.add_delete("/admin/replicas", self.remove_replica)
        app.router.add_post("/admin/replicas/drain", self.drain_replica)
        app.router.add_post("/admin/reload", self.reload)
        app.router.add_get("/admin/state", self.state)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        given = bearer_token(request.headers)
        if given is None or not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self._token):
            return error_response(401, "admin token missing or wrong", "invalid_request_error",
                                  {"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(exc.status, exc.reason, "invalid_request_error")

    async def _url_from_body(self, request: web.Request) -> str:
        try:
            data = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            raise web.HTTPBadRequest(reason="body must be JSON: {\"url\": \"http://host:port\"}") from None
        url = data.get("url") if isinstance(data, dict) else None
        return self._normalize(url)

    @staticmethod
    def _normalize(url: object) -> str:
        try:
            return normalize_replica_url(url)  # type: ignore[arg-type]
        except (ValueError, TypeError) as err:
            raise web.HTTPBadRequest(reason=f"url: {err}") from None

    def _replicas(self) -> list[dict[str, Any]]:
        registry = self.router.registry
        out = []
        for view in registry.snapshot().replicas:
            row = dataclasses.asdict(view)
            row["url"] = row.pop("id")
            del row["cost_terms"]  # the cost model's cache, not the replica's state
            row["draining"] = self.membership.is_draining(view.id)
            out.append(row)
        return out

    async def list_replicas(self, request: web.Request) -> web.StreamResponse:
        return _json({"replicas": self._replicas()})

    async def add_replica(self, request: web.Request) -> web.StreamResponse:
        url = await self._url_from_body(request)
        added = self.membership.add(url)
        log.info("admin: add replica %s (%s)", url, "added" if added else "already known")
        return _json({"url": url, "added": added}, 201 if added else 200)

    async def remove_replica(self, request: web.Request) -> web.StreamResponse:
        url = self._normalize(request.query.get("url"))
        if not self.membership.remove(url):
            return error_response(404, f"unknown replica {url}", "not_found")
        log.info("admin: removed replica %s", url)
        return _json({"url": url, "removed": True})

    async def drain_replica(self, request: web.Request) -> web.StreamResponse:
        url = await self._url_from_body(request)
        if not self.membership.drain(url):
            return error_response(404, f"unknown replica {url}", "not_found")
        view = self.router.registry.view(url)
        return _json({"url": url, "draining": True, "in_flight": view.in_flight if view else 0}, 202)

    async def reload(self, request: web.Request) -> web.StreamResponse:
        if self.reader is None:
            return error_response(409, "router was started without a config file", "conflict")
        try:
            config = self.reader()
        except ConfigError as err:
            log.error("admin reload refused, keeping the running config: %s", err)
            return error_response(400, f"reload refused: {err}", "invalid_request_error")
        if config is None:
            return error_response(409, "router was started without a config file", "conflict")
        changes = self.membership.reload(config)
        log.info("admin: config reloaded: %s", ", ".join(changes) or "no routing change")
        return _json({"changes": changes})

    async def state(self, request: web.Request) -> web.StreamResponse:
        r = self.router
        return _json({
            "sessions": len(r.table),
            "policy": {"name": r.config.policy.name, "params": r.config.policy.params},
            "replicas": self._replicas(),
            "affinity": {"store": r.config.affinity.store, "degraded": r.affinity.degraded},
            "shutting_down": r.shutting_down,
        })


async def start_admin_site(
    router: Router, token: str, host: str, port: int, reader: Reader | None = None
) -> tuple[web.AppRunner, int]:
    runner = JSONErrorAppRunner(AdminAPI(router, token, reader).build_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]
