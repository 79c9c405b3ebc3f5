"""Kubernetes discovery: list, then watch, the EndpointSlices of one Service.

Speaks the API's list/watch protocol with aiohttp directly (the router already depends on it;
two GET requests do not justify a generated client and its dependency tree):

1. LIST ``/apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices?labelSelector=
   kubernetes.io/service-name=<svc>`` (paged with ``limit``/``continue``); the list's
   ``metadata.resourceVersion`` is where the watch starts.
2. WATCH the same path with ``watch=1&resourceVersion=<rv>&allowWatchBookmarks=true``: a chunked
   stream of one JSON object per line, ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR,
   "object": ...}``. Every event moves the resourceVersion on; when the server ends the stream
   (``timeoutSeconds``) the watch resumes from there.
3. ``410 Gone`` (as the watch's HTTP status or as an ``ERROR`` event with ``code: 410``) means the
   resourceVersion is too old: relist and watch again.

In-cluster auth: the bearer token (re-read at every request, as bound tokens rotate) and CA from
the service-account directory; the API address from ``KUBERNETES_SERVICE_HOST``/``_PORT``.
Endpoints whose ``conditions.ready`` is false (unready or terminating pods) are left out, so they
are drained at once; a missing condition counts as ready, as the API documents.

A disaggregated fleet is two Services, prefill and decode, watched together with the set-based
selector ``kubernetes.io/service-name in (<prefill>,<decode>)``; a slice's role is its Service
(the same label). A prefill slice's port named ``bootstrap_port_name`` is the bootstrap port.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .discovery import Endpoint, Publish, Role
from .discovery_config import KubernetesDiscoveryConfig

LIST_PAGE = 500
SERVICE_LABEL = "kubernetes.io/service-name"  # set on every EndpointSlice by its controller


class Gone(Exception):
    """The watch's resourceVersion is no longer available (HTTP 410): relist."""


class KubernetesSource:
    name = "kubernetes"

    def __init__(
        self, config: KubernetesDiscoveryConfig, on_error: Callable[[str, str], None]
    ) -> None:
        self.config = config
        self.on_error = on_error
        sa = Path(config.service_account_dir)
        self.token_path = sa / "token"
        self.ca_path = sa / "ca.crt"
        self.namespace = config.namespace or self._read(sa / "namespace")
        if not self.namespace:
            raise ValueError(
                f"discovery.kubernetes.namespace not set and {sa / 'namespace'} not readable"
            )
        self.api = (config.api_server or self._in_cluster_api()).rstrip("/")
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
        if config.decode_service is None:
            self.selector = f"{SERVICE_LABEL}={config.service}"
        else:
            self.selector = f"{SERVICE_LABEL} in ({config.service},{config.decode_service})"
        self.slices: dict[str, set[Endpoint]] = {}
        self.resource_version: str | None = None
        self.lists = 0  # how many times the slices were listed (tests)
        self._gone_after_list = False

    @staticmethod
    def _read(path: Path) -> str | None:
        try:
            return path.read_text().strip() or None
        except OSError:
            return None

    @staticmethod
    def _in_cluster_api() -> str:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError(
                "discovery.kubernetes: not in a cluster (KUBERNETES_SERVICE_HOST unset) and no api_server"
            )
        if ":" in host:
            host = f"[{host}]"
        return f"https://{host}:{port}"

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self._read(self.token_path)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.api.startswith("https://"):
            return True
        if self.ca_path.exists():
            return ssl.create_default_context(cafile=str(self.ca_path))
        return ssl.create_default_context()

    # -- EndpointSlice -> endpoints ---------------------------------------------------------------
    def slice_role(self, obj: dict[str, Any]) -> Role | None:
        """None for a colocated fleet's slices; in a PD fleet, the role of the slice's Service."""
        c = self.config
        if c.decode_service is None:
            return None
        service = ((obj.get("metadata") or {}).get("labels") or {}).get(SERVICE_LABEL)
        return "decode" if service == c.decode_service else "prefill"

    def slice_urls(self, obj: dict[str, Any]) -> set[Endpoint]:
        c = self.config
        port = c.port
        bootstrap = None
        for p in obj.get("ports") or []:
            if p.get("name") == c.bootstrap_port_name:
                bootstrap = p.get("port")
            elif port is None and (c.port_name is None or p.get("name") == c.port_name):
                port = p.get("port")
        if port is None:
            return set()
        role = self.slice_role(obj)
        if role != "prefill":
            bootstrap = None
        ipv6 = obj.get("addressType") == "IPv6"
        urls = set()
        for endpoint in obj.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if ipv6 else address
                urls.add(Endpoint(f"{c.scheme}://{host}:{port}", role, bootstrap))
        return urls

    def current(self) -> set[Endpoint]:
        out: set[Endpoint] = set()
        for urls in self.slices.values():
            out |= urls
        return out

    # -- protocol ----------------------------------------------------------------------------------
    async def list(self, session: aiohttp.ClientSession) -> None:
        slices: dict[str, set[str]] = {}
        params = {"labelSelector": self.selector, "limit": str(LIST_PAGE)}
        while True:
            async with session.get(self.api + self.path, params=params, headers=self._headers(),
                                   ssl=self._ssl()) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(
                        resp.request_info, (), status=resp.status,
                        message=(await resp.text())[:200],
                    )
                body = orjson.loads(await resp.read())
            for item in body.get("items") or []:
                slices[item["metadata"]["name"]] = self.slice_urls(item)
            meta = body.get("metadata") or {}
            if not meta.get("continue"):
                break
            params = {**params, "continue": meta["continue"]}
        self.slices = slices
        self.resource_version = meta.get("resourceVersion")
        self.lists += 1

    async def _lines(self, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """One watch event per line; no line-length limit (an EndpointSlice of 1000 endpoints
        is ~100 KB, beyond aiohttp's readline limit)."""
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    yield line
        if buf.strip():
            yield buf

    async def watch(self, session: aiohttp.ClientSession, publish: Publish) -> None:
        """One watch request, until the server ends it. Raises Gone on 410."""
        params = {
            "labelSelector": self.selector, "watch": "1", "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.config.watch_timeout_s),
        }
        if self.resource_version:
            params["resourceVersion"] = self.resource_version
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10,
                                        sock_read=self.config.watch_timeout_s + 30)
        async with session.get(self.api + self.path, params=params, headers=self._headers(),
                               ssl=self._ssl(), timeout=timeout) as resp:
            if resp.status == 410:
                raise Gone()
            if resp.status != 200:
                raise aiohttp.ClientResponseError(
                    resp.request_info, (), status=resp.status, message=(await resp.text())[:200]
                )
            async for line in self._lines(resp):
                event = orjson.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise aiohttp.ClientPayloadError(f"watch error: {obj.get('message', obj)}")
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self.resource_version = rv
                if kind == "BOOKMARK":
                    continue
                name = (obj.get("metadata") or {}).get("name")
                if not name:
                    continue
                if kind == "DELETED":
                    self.slices.pop(name, None)
                elif kind in ("ADDED", "MODIFIED"):
                    self.slices[name] = self.slice_urls(obj)
                else:
                    continue
                publish(self.current())

    async def run(self, publish: Publish) -> None:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            need_list = True
            while True:
                try:
                    self._gone_after_list = need_list
                    if need_list:
                        await self.list(session)
                        need_list = False
                        publish(self.current())
                    started = loop.time()
                    await self.watch(session, publish)  # ends at timeoutSeconds: resume
                    if loop.time() - started < 1.0:  # a proxy cutting watches short: no hot loop
                        await asyncio.sleep(min(1.0, self.config.retry_interval_s))
                except Gone:
                    if need_list is False and self._gone_after_list:
                        await asyncio.sleep(self.config.retry_interval_s)  # 410 right after a list
                    need_list = True  # history compacted past our resourceVersion
                except asyncio.CancelledError:
                    raise
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError) as err:
                    self.on_error(self.name, f"{type(err).__name__}: {err}")
                    await asyncio.sleep(self.config.retry_interval_s)
