"""Admin API: separate port, bearer token from the environment, no admin route on the data port."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from kvrouter.router.admin import admin_token, start_admin_site
from kvrouter.router.config import AdminConfig, ConfigError, parse_config

from .fakes import FakeUpstream
from .procs import start_router_proc, wait_http
from kvrouter.loadtest.process_group import free_port

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
ADMIN_ROUTES = [("GET", "/admin/replicas"), ("POST", "/admin/replicas"), ("DELETE", "/admin/replicas"),
                ("POST", "/admin/replicas/drain"), ("POST", "/admin/reload"), ("GET", "/admin/state")]


@pytest.fixture
async def admin(start_app, start_router):
    runners = []

    async def _start(n: int = 2, reader=None, **overrides):
        ups = [FakeUpstream(name=f"u{i}") for i in range(n)]
        urls = [await start_app(u.app()) for u in ups]
        router, url = await start_router(urls, policy={"name": "round_robin"},
                                         signals={"source": "health", "interval_s": 0.05}, **overrides)
        runner, port = await start_admin_site(router, TOKEN, "127.0.0.1", 0, reader)
        runners.append(runner)
        return router, url, f"http://127.0.0.1:{port}", ups, urls

    yield _start
    for r in runners:
        await r.cleanup()


def test_admin_disabled_without_token():
    assert admin_token(AdminConfig(), {}) is None
    assert admin_token(AdminConfig(), {"KVROUTER_ADMIN_TOKEN": ""}) is None
    assert admin_token(AdminConfig(token_env="MY_TOKEN"), {"MY_TOKEN": "t"}) == "t"
    assert admin_token(AdminConfig(enabled=False), {"KVROUTER_ADMIN_TOKEN": "t"}) is None


async def test_admin_requires_the_token(admin):
    _, _, admin_url, _, _ = await admin()
    async with aiohttp.ClientSession() as client:
        for method, path in ADMIN_ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                            {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
                async with client.request(method, admin_url + path, headers=headers) as resp:
                    assert resp.status == 401, (method, path, headers)
                    assert resp.headers["WWW-Authenticate"] == "Bearer"
                    body = await resp.json()
                    assert body["error"]["code"] == 401 and TOKEN not in str(body)


async def test_no_admin_route_on_the_data_port(admin):
    _, url, _, ups, _ = await admin()
    async with aiohttp.ClientSession() as client:
        for method, path in ADMIN_ROUTES:
            async with client.request(method, url + path, headers=AUTH, json={"url": "http://127.0.0.1:1"}) as resp:
                assert resp.status in (404, 405), (method, path)
                assert "error" in await resp.json()
    assert all(not u.requests for u in ups)


async def test_add_remove_list_state(admin, start_app):
    router, url, admin_url, _, urls = await admin()
    extra = FakeUpstream(name="extra")
    extra_url = await start_app(extra.app())
    async with aiohttp.ClientSession(headers=AUTH) as client:
        async with client.get(admin_url + "/admin/replicas") as r:
            assert [x["url"] for x in (await r.json())["replicas"]] == urls
        for bad in ({"url": "ftp://x"}, {"url": 5}, {}, [1]):
            async with client.post(admin_url + "/admin/replicas", json=bad) as r:
                assert r.status == 400 and "error" in await r.json()
        async with client.post(admin_url + "/admin/replicas", data=b"{not json") as r:
            assert r.status == 400
        async with client.post(admin_url + "/admin/replicas", json={"url": extra_url + "/"}) as r:
            assert r.status == 201 and (await r.json()) == {"url": extra_url, "added": True}
        async with client.post(admin_url + "/admin/replicas", json={"url": extra_url}) as r:
            assert r.status == 200 and (await r.json())["added"] is False
        assert extra_url in router.registry
        for _ in range(6):
            async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
        assert extra.requests  # the new replica takes traffic
        async with client.delete(admin_url + "/admin/replicas", params={"url": extra_url}) as r:
            assert r.status == 200
        async with client.delete(admin_url + "/admin/replicas", params={"url": extra_url}) as r:
            assert r.status == 404
        async with client.delete(admin_url + "/admin/replicas") as r:
            assert r.status == 400
        assert extra_url not in router.registry
        async with client.get(admin_url + "/admin/state") as r:
            state = await r.json()
        assert state["policy"]["name"] == "round_robin"
        assert [x["url"] for x in state["replicas"]] == urls
        assert state["sessions"] == 0 and state["shutting_down"] is False
        assert {"healthy", "in_flight", "draining"} <= set(state["replicas"][0])


async def test_drain_stops_new_work_lets_in_flight_finish_then_removes(admin):
    hold = asyncio.Event()
    router, url, admin_url, ups, urls = await admin()
    ups[0].hold_after_first = hold
    ups[0].chunks = 3
    async with aiohttp.ClientSession(headers=AUTH) as client:
        # round robin: the first request goes to u0 and is held mid-stream
        inflight = await client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
        assert inflight.headers["x-upstream"] == "u0"
        await asyncio.wait_for(inflight.content.readuntil(b"\n\n"), 5)
        async with client.post(admin_url + "/admin/replicas/drain", json={"url": urls[0]}) as r:
            assert r.status == 202 and (await r.json())["in_flight"] == 1
        for _ in range(6):
            async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
                assert r.headers["x-upstream"] == "u1"  # no new work on the draining replica
        await asyncio.sleep(0.3)  # health polls keep succeeding: draining must not be undone
        assert urls[0] in router.registry and not router.registry.view(urls[0]).healthy
        hold.set()
        assert (await asyncio.wait_for(inflight.read(), 5)).endswith(b"data: [DONE]\n\n")
        for _ in range(50):
            if urls[0] not in router.registry:
                break
            await asyncio.sleep(0.1)
        assert urls[0] not in router.registry  # removed once its in-flight request ended
        async with client.post(admin_url + "/admin/replicas/drain", json={"url": urls[0]}) as r:
            assert r.status == 404


async def test_reload_applies_a_valid_config_and_refuses_an_invalid_one(admin):
    current = {"data": None}

    def reader():
        if current["data"] == "bad":
            raise ConfigError("router.yaml: policy.name: unknown policy 'nope'")
        return parse_config(current["data"])

    router, _, admin_url, _, urls = await admin(reader=reader)
    current["data"] = {"replicas": urls, "policy": {"name": "random"}}
    async with aiohttp.ClientSession(headers=AUTH) as client:
        async with client.post(admin_url + "/admin/reload") as r:
            assert r.status == 200 and (await r.json())["changes"] == ["policy -> random"]
        current["data"] = "bad"
        async with client.post(admin_url + "/admin/reload") as r:
            assert r.status == 400 and "unknown policy" in (await r.json())["error"]["message"]
    assert router.config.policy.name == "random"


@pytest.mark.timeout(60)
async def test_serve_process_admin_port_and_token_from_env(start_app, tmp_path):
    up = FakeUpstream()
    replica = await start_app(up.app())
    admin_port = free_port()
    proc, url, _ = start_router_proc(tmp_path, {"replicas": [replica], "admin": {"port": admin_port}},
                                     env={"KVROUTER_ADMIN_TOKEN": TOKEN})
    admin_url = f"http://127.0.0.1:{admin_port}"
    try:
        await wait_http(url, "/ready")
        async with aiohttp.ClientSession() as client:
            async with client.get(admin_url + "/admin/state", headers=AUTH) as r:
                assert r.status == 200 and (await r.json())["replicas"][0]["url"] == replica
            async with client.get(admin_url + "/admin/state") as r:
                assert r.status == 401
            async with client.get(url + "/admin/state", headers=AUTH) as r:
                assert r.status == 404
        proc.signal(signal.SIGTERM)
        assert await proc.wait(20) == 0
    finally:
        proc.stop()
    log = proc.log()
    assert f"admin API on http://127.0.0.1:{admin_port}" in log
    assert TOKEN not in log


@pytest.mark.timeout(60)
async def test_serve_process_without_token_has_no_admin_port(start_app, tmp_path):
    replica = await start_app(FakeUpstream().app())
    admin_port = free_port()
    proc, url, _ = start_router_proc(tmp_path, {"replicas": [replica], "admin": {"port": admin_port}},
                                     env={"KVROUTER_ADMIN_TOKEN": ""})
    try:
        await wait_http(url, "/ready")
        async with aiohttp.ClientSession() as client:
            with pytest.raises(aiohttp.ClientConnectorError):
                async with client.get(f"http://127.0.0.1:{admin_port}/admin/state", headers=AUTH):
                    pass
        proc.signal(signal.SIGTERM)
        assert await proc.wait(20) == 0
    finally:
        proc.stop()
    assert "admin API disabled" in proc.log()
