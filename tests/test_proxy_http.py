"""Router HTTP surface: headers, request ids, error shapes, router endpoints."""

from __future__ import annotations

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from .fakes import FakeUpstream

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def test_hop_by_hop_headers_stripped_and_body_intact(start_app, start_router):
    up = FakeUpstream()
    _, router_url = await start_router([await start_app(up.app())])
    raw = orjson.dumps({**CHAT, "extra": {"nested": [1, 2, 3]}})
    headers = {
        "Connection": "keep-alive, x-private-hop",
        "x-private-hop": "secret",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Proxy-Authorization": "Basic Zm9v",
        "Upgrade": "h2c",
        "Authorization": "Bearer client-key",
        "x-session-id": "abc",
        "Content-Type": "application/json",
    }
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", data=raw, headers=headers) as resp:
            assert resp.status == 200
            rid = resp.headers["x-request-id"]
            assert len(rid) >= 16
    seen = {k.lower(): v for k, v in up.requests[0]["headers"].items()}
    for hop in ("x-private-hop", "keep-alive", "te", "proxy-authorization", "upgrade"):
        assert hop not in seen, hop
    assert seen["authorization"] == "Bearer client-key"
    assert seen["x-session-id"] == "abc"
    assert seen["x-request-id"] == rid
    assert up.requests[0]["raw"] == raw


async def test_client_request_id_is_kept(start_app, start_router):
    up = FakeUpstream()
    _, router_url = await start_router([await start_app(up.app())])
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", json=CHAT,
                               headers={"x-request-id": "req-123"}) as resp:
            assert resp.headers["x-request-id"] == "req-123"
    assert up.requests[0]["headers"]["x-request-id"] == "req-123"


async def _error(resp: aiohttp.ClientResponse) -> dict:
    assert resp.content_type == "application/json"
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "code"}
    return err


async def test_bad_requests_get_openai_shaped_4xx(start_app, start_router):
    up = FakeUpstream()
    _, router_url = await start_router(
        [await start_app(up.app())], server={"host": "127.0.0.1", "port": 0, "max_body_bytes": 1000}
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", data=b"x" * 5000) as resp:
            assert resp.status == 413
            assert (await _error(resp))["code"] == 413
        async with client.post(router_url + "/v1/chat/completions", data=b"{not json") as resp:
            assert resp.status == 400
            assert "invalid JSON" in (await _error(resp))["message"]
        async with client.post(router_url + "/v1/completions", data=b"[1, 2]") as resp:
            assert resp.status == 400
            await _error(resp)
        async with client.get(router_url + "/v1/nope") as resp:
            assert resp.status == 404
            await _error(resp)
        async with client.get(router_url + "/v1/chat/completions") as resp:
            assert resp.status == 405
            await _error(resp)
    assert up.requests == []  # nothing bad was forwarded


async def test_a_body_is_read_whole_with_and_without_a_declared_length(start_app, start_router):
    up = FakeUpstream()
    _, router_url = await start_router(
        [await start_app(up.app())], server={"host": "127.0.0.1", "port": 0, "max_body_bytes": 3000}
    )
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"y" * 2000 + b'"}]}'

    async def chunked(data: bytes):  # no Content-Length: sent in pieces
        for start in range(0, len(data), 700):
            yield data[start:start + 700]

    async with aiohttp.ClientSession() as client:
        for data in (body, chunked(body)):
            async with client.post(router_url + "/v1/chat/completions", data=data) as resp:
                assert resp.status == 200
                await resp.read()
        big = body.replace(b"y" * 2000, b"y" * 4000)
        async with client.post(router_url + "/v1/chat/completions", data=chunked(big)) as resp:
            assert resp.status == 413
            assert (await _error(resp))["code"] == 413
    assert [r["raw"] for r in up.requests] == [body, body]


async def test_models_merged_from_replicas(start_app, start_router):
    a, b = FakeUpstream(model="model-a"), FakeUpstream(model="model-b")
    _, router_url = await start_router([await start_app(a.app()), await start_app(b.app())])
    async with aiohttp.ClientSession() as client:
        async with client.get(router_url + "/v1/models") as resp:
            body = await resp.json()
    assert body["object"] == "list"
    assert sorted(m["id"] for m in body["data"]) == ["model-a", "model-b"]


async def test_health_ready_metrics(start_app, start_router, closed_port_url):
    up = FakeUpstream()
    router, router_url = await start_router([await start_app(up.app())])
    async with aiohttp.ClientSession() as client:
        await (await client.post(router_url + "/v1/chat/completions", json=CHAT)).read()
        assert (await client.get(router_url + "/health")).status == 200
        assert (await client.get(router_url + "/ready")).status == 200
        text = await (await client.get(router_url + "/metrics")).text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "kvrouter_requests" in families  # parser strips _total from counter family names
    samples = families["kvrouter_requests"].samples
    assert any(s.labels == {"route": "/v1/chat/completions", "status": "200"} and s.value == 1
               for s in samples if s.name == "kvrouter_requests_total")
    for name in ("kvrouter_upstream_ttfb_seconds", "kvrouter_request_duration_seconds",
                 "kvrouter_replica_in_flight_requests"):
        assert name in families, name


async def test_ready_is_503_when_no_replica_is_healthy(start_router, closed_port_url):
    router, router_url = await start_router(
        [closed_port_url], signals={"interval_s": 0.05, "failure_threshold": 1, "timeout_s": 0.5}
    )
    async with aiohttp.ClientSession() as client:
        for _ in range(100):
            resp = await client.get(router_url + "/ready")
            if resp.status == 503:
                break
            import asyncio
            await asyncio.sleep(0.02)
        assert resp.status == 503
        assert (await resp.json())["ready"] is False
