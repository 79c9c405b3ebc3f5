"""A local stand-in for the Kubernetes API server's EndpointSlice list/watch (discovery.k8s.io/v1).

Speaks the real protocol on 127.0.0.1: LIST returns an EndpointSliceList with a resourceVersion;
`?watch=1` returns a chunked stream of `{"type", "object"}` lines fed from a queue; a watch from
a resourceVersion older than `compacted_before` gets HTTP 410 Gone, and a test can also push an
`ERROR` event with a 410 Status, as a real API server does when history is compacted mid-watch.
"""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

SLICES_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


def endpoint_slice(
    name: str, service: str, addresses: list[str], *, port: int = 30000, port_name: str = "http",
    ready: dict[str, bool] | None = None, address_type: str = "IPv4", rv: int = 1,
    bootstrap_port: int | None = None,
) -> dict[str, Any]:
    ready = ready or {}
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": "inference", "resourceVersion": str(rv),
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": address_type,
        "endpoints": [
            {"addresses": [a], "conditions": {"ready": ready.get(a, True), "serving": True,
                                               "terminating": not ready.get(a, True)}}
            for a in addresses
        ],
        "ports": ([{"name": "bootstrap", "port": bootstrap_port, "protocol": "TCP"}] if bootstrap_port else [])
        + [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


def selected_services(selector: str) -> set[str]:
    """The Services a `kubernetes.io/service-name` selector names: `=name` or `in (a,b)`."""
    key = "kubernetes.io/service-name"
    if selector.startswith(key + "="):
        return {selector[len(key) + 1:]}
    if selector.startswith(key + " in (") and selector.endswith(")"):
        return {name.strip() for name in selector[len(key) + 5:-1].split(",")}
    return set()


def _service(obj: dict[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get("kubernetes.io/service-name")


@dataclass
class FakeKubeAPI:
    namespace: str = "inference"
    service: str = "sglang"
    other_services: tuple[str, ...] = ()  # more Services a selector may name (a PD fleet's decode)
    token: str = "test-token"
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    resource_version: int = 100
    compacted_before: int = 0  # a watch from an older resourceVersion gets 410 Gone
    lists: int = 0
    watches: list[dict[str, str]] = field(default_factory=list)
    unauthorized: int = 0
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(SLICES_PATH.format(namespace=self.namespace), self.handle)
        return app

    def bump(self) -> str:
        self.resource_version += 1
        return str(self.resource_version)

    def push(self, kind: str, obj: dict[str, Any]) -> None:
        """Change the stored state and emit the matching watch event."""
        if kind in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            obj = {**obj, "metadata": {**obj.get("metadata", {}), "resourceVersion": self.bump()}}
        name = obj.get("metadata", {}).get("name")
        if kind in ("ADDED", "MODIFIED"):
            self.slices[name] = obj
        elif kind == "DELETED":
            self.slices.pop(name, None)
        self.events.put_nowait({"type": kind, "object": obj})

    def push_gone(self) -> None:
        self.compacted_before = self.resource_version  # a relist (at this version) may watch again
        self.events.put_nowait({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
            "message": "too old resource version", "code": 410}})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.unauthorized += 1
            return web.json_response({"kind": "Status", "code": 401, "reason": "Unauthorized"}, status=401)
        q = request.query
        services = selected_services(q.get("labelSelector") or "")
        if not services or not services <= {self.service, *self.other_services}:
            return web.json_response({"kind": "Status", "code": 400, "message": "bad selector"}, status=400)
        if q.get("watch") not in ("1", "true"):
            self.lists += 1
            return web.json_response({
                "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.resource_version)},
                "items": [s for s in self.slices.values() if _service(s) in services],
            })
        self.watches.append(dict(q))
        rv = int(q.get("resourceVersion") or 0)
        if rv < self.compacted_before:
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired",
                                      "message": "too old resource version"}, status=410)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        while True:
            event = await self.events.get()
            if event["type"] in ("ADDED", "MODIFIED", "DELETED") and _service(event["object"]) not in services:
                continue  # not selected: a real API server filters it out too
            await resp.write(orjson.dumps(event) + b"\n")
            if event["type"] == "ERROR":
                await resp.write_eof()
                return resp


def self_signed_cert(directory: Path) -> tuple[Path, Path] | None:
    """A certificate for IP 127.0.0.1 (its own CA) made with the openssl CLI, or None."""
    cert, key = directory / "server.crt", directory / "server.key"
    try:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
             "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True, timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return cert, key
