"""Routing hints cannot pick an arbitrary upstream (no SSRF): off by default, known replicas only."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from .fakes import FakeUpstream
from .fault_ledger import fake_counts

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
HINT = "x-smg-target-worker"


@pytest.fixture
async def trap():
    """A listener on another loopback port that must never receive a connection."""
    connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield port, connections
    server.close()
    await server.wait_closed()


def evil_targets(port: int) -> list[object]:
    return [
        f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/", f"http://localhost:{port}",
        f"http://127.0.0.1:{port}/v1/chat/completions", f"http://user:pw@127.0.0.1:{port}",
        f"https://127.0.0.1:{port}", f"http://127.1:{port}", f"http://[::1]:{port}",
        "file:///etc/passwd", "gopher://127.0.0.1:70/", "", " ", "not a url", "http://", "//127.0.0.1",
    ]


async def _fleet(start_app, start_router, **routing):
    ups = [FakeUpstream(name=f"u{i}") for i in range(2)]
    urls = [await start_app(u.app()) for u in ups]
    router, url = await start_router(urls, policy={"name": "round_robin"},
                                     signals={"source": "health", "interval_s": 60}, routing=routing)
    return ups, urls, url


@pytest.mark.fault_matrix(
    fault="Routing hint naming an unknown upstream (SSRF attempt), hints disabled (default)",
    clients_saw="hint ignored, header and body field stripped; request routed by policy (200); no connection to the named host",
)
async def test_hints_off_by_default_are_ignored_and_stripped(start_app, start_router, trap, fault_record):
    port, connections = trap
    ups, urls, url = await _fleet(start_app, start_router)
    sent = 0
    async with aiohttp.ClientSession() as client:
        for target in evil_targets(port) + [urls[1]]:
            for how in ("header", "body"):
                headers = {HINT: target} if how == "header" and isinstance(target, str) and target.strip() else {}
                body = {**CHAT, "target_worker": target} if how == "body" else CHAT
                async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert (await fault_record.observe(r)).kind == "complete"
                    sent += 1
    assert connections[0] == 0
    seen = [req for u in ups for req in u.requests]
    assert len(seen) == sent
    assert all(HINT not in req["headers"] for req in seen)  # stripped before forwarding
    assert all("target_worker" not in req["body"] for req in seen)  # the body field too
    assert all(req["body"]["messages"] == CHAT["messages"] for req in seen)
    # policy (round robin), not the hint, chose: both replicas served
    assert all(u.requests for u in ups)
    for i, u in enumerate(ups):
        fault_record.replica(fake_counts(f"u{i}", u))


@pytest.mark.fault_matrix(
    fault="Routing hint naming an unknown upstream (SSRF attempt), hints enabled",
    clients_saw="400 OpenAI-shaped error; no outbound request; known replicas honoured",
)
async def test_enabled_hints_only_among_known_replicas(start_app, start_router, trap, fault_record):
    port, connections = trap
    ups, urls, url = await _fleet(start_app, start_router, allow_target_hint=True)
    rejected = 0
    async with aiohttp.ClientSession() as client:
        for target in evil_targets(port):
            for how in ("header", "body"):
                if how == "header" and not target.strip():
                    continue
                headers = {HINT: target} if how == "header" else {}
                body = {**CHAT, "target_worker": target} if how == "body" else CHAT
                async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    outcome = await fault_record.observe(r)
                    assert (outcome.kind, r.status) == ("clean_error", 400), (how, target)
                    err = (await r.json())["error"]
                    assert err["type"] == "invalid_request_error" and str(port) not in err["message"]
                    rejected += 1
        for bad in (5, None, ["x"], {"url": urls[0]}, True):
            if bad is None:
                continue  # an explicit null is "no hint"
            async with client.post(url + "/v1/chat/completions", json={**CHAT, "target_worker": bad}) as r:
                outcome = await fault_record.observe(r)
                assert (outcome.kind, r.status) == ("clean_error", 400)
                rejected += 1
        assert all(not u.requests for u in ups)  # nothing went anywhere
        honoured = 0
        for _ in range(4):
            for i, target in enumerate(urls):
                async with client.post(url + "/v1/chat/completions", json=CHAT,
                                       headers={HINT: target + "/"}) as r:
                    assert (await fault_record.observe(r)).kind == "complete"
                    assert r.headers["x-upstream"] == f"u{i}"
                    honoured += 1
        async with client.post(url + "/v1/chat/completions", json={**CHAT, "target_worker": urls[1]}) as r:
            assert (await fault_record.observe(r)).kind == "complete"
            assert r.headers["x-upstream"] == "u1"
            honoured += 1
    assert connections[0] == 0
    assert all(HINT not in req["headers"] for u in ups for req in u.requests)
    assert all("target_worker" not in req["body"] for u in ups for req in u.requests)
    for i, u in enumerate(ups):
        fault_record.replica(fake_counts(f"u{i}", u))


async def test_hint_to_an_unhealthy_or_draining_replica_is_refused(start_app, start_router):
    ups = [FakeUpstream(name=f"u{i}") for i in range(2)]
    urls = [await start_app(u.app()) for u in ups]
    router, url = await start_router(urls, signals={"source": "health", "interval_s": 60},
                                     routing={"allow_target_hint": True})
    router.membership.drain(urls[0])
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/chat/completions", json=CHAT, headers={HINT: urls[0]}) as r:
            assert r.status == 503 and r.headers["Retry-After"]
    assert not ups[0].requests
