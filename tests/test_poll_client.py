"""The poller's HTTP exchanges, against a real aiohttp server on 127.0.0.1: the upstream
headers go with every scrape (and no Content-Length), one keep-alive connection serves poll
after poll, a redirect within the replica is followed and one elsewhere is not, and a page too
large, a body too slow or a replica that left ends as a failed poll or a closed connection,
never a stuck poller."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from aiohttp import web

from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.router import poller as poller_module
from kvrouter.router.config import SignalsConfig
from kvrouter.router.poller import SignalPoller
from kvrouter.router.replicas import ReplicaRegistry

from .test_poll_page_reuse import page


@pytest.fixture
async def server(start_app):
    """A replica whose /metrics answers as `state["metrics"]` says; every request's path and
    Authorization header, and every connection it accepted, are recorded."""
    state: dict[str, Any] = {"metrics": "page", "seen": [], "peers": set(), "lengths": set()}

    async def metrics(request: web.Request) -> web.StreamResponse:
        state["seen"].append((request.path, request.headers.get("Authorization")))
        state["peers"].add(request.transport.get_extra_info("peername"))
        state["lengths"].add(request.headers.get("Content-Length"))
        how = state["metrics"]
        if how == "redirect":
            raise web.HTTPTemporaryRedirect("/metrics/")
        if how == "redirect-away":
            raise web.HTTPTemporaryRedirect("http://127.0.0.2:9/metrics")
        if how == "large":
            return web.Response(body=b"# x\n" * 1000, content_type="text/plain")
        if how == "slow":
            response = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await response.prepare(request)
            await response.write(page(7)[:100])
            await asyncio.sleep(1.5)  # well past timeout_s (0.3 s)
            return response
        return web.Response(body=page(7), content_type="text/plain")

    async def moved(request: web.Request) -> web.Response:
        state["seen"].append((request.path, request.headers.get("Authorization")))
        return web.Response(body=page(5), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/metrics/", moved)
    return await start_app(app), state


def make_poller(url: str, **config: Any) -> SignalPoller:
    return SignalPoller(ReplicaRegistry([url]), RouterMetrics(), SignalsConfig(**config),
                        headers={"Authorization": "Bearer replica-key"})


def poll_errors(poller: SignalPoller, url: str) -> float:
    return poller.metrics.registry.get_sample_value("kvrouter_replica_poll_errors_total", {"replica": url}) or 0.0


async def test_scrapes_carry_the_upstream_headers_on_one_kept_alive_connection(server):
    url, state = server
    poller = make_poller(url)
    async with contextlib.aclosing(poller):
        for _ in range(3):
            await poller.poll_all()
    assert state["seen"] == [("/metrics", "Bearer replica-key")] * 3
    assert len(state["peers"]) == 1  # one connection, kept alive
    assert state["lengths"] == {None}  # a GET without a body says nothing of one
    assert poller.registry.view(url).num_running_reqs == 7


async def test_a_redirect_within_the_replica_is_followed(server):
    url, state = server
    state["metrics"] = "redirect"
    poller = make_poller(url)
    async with contextlib.aclosing(poller):
        await poller.poll_all()
    assert [path for path, _ in state["seen"]] == ["/metrics", "/metrics/"]
    assert state["seen"][1][1] == "Bearer replica-key"
    assert poller.registry.view(url).num_running_reqs == 5 and poll_errors(poller, url) == 0


@pytest.mark.parametrize("how", ["redirect-away", "large", "slow"])
async def test_a_redirect_elsewhere_a_page_too_large_or_too_slow_is_a_failed_poll(server, how, monkeypatch):
    url, state = server
    state["metrics"] = how
    monkeypatch.setattr(poller_module, "_MAX_PAGE_BYTES", 2000)
    poller = make_poller(url, timeout_s=0.3)
    async with contextlib.aclosing(poller):
        async with asyncio.timeout(3):  # the slow body is cut at timeout_s
            await poller.poll_all()
        assert poll_errors(poller, url) == 1
        assert poller.registry.view(url).num_running_reqs is None
        if how == "slow":  # cut mid-body: the connection is aborted, not pooled
            assert poller.pool.connections() == []
    assert [path for path, _ in state["seen"]] == ["/metrics"]  # never left the replica


async def test_a_removed_replicas_connection_is_closed(server):
    url, state = server
    poller = make_poller(url)
    async with contextlib.aclosing(poller):
        await poller.poll_all()
        assert len(poller.pool.connections()) == 1  # idle, kept for the next poll
        poller.registry.remove(url)
        await poller.poll_all()  # the round's end forgets it
        assert poller.pool.connections() == []
