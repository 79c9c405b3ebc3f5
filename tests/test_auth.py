"""Client API keys, per-key concurrency limits, and upstream credentials never leaking."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from kvrouter.router import security
from kvrouter.router.config import AuthConfig

from .fakes import FakeUpstream
from .fault_ledger import fake_counts, read_outcome

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
KEYS = ("key-alpha-123", "key-beta-456")
UPSTREAM_SECRET = "sk-upstream-DO-NOT-LEAK-9f8e7d"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_constant_time_compare_checks_every_key(monkeypatch):
    calls = []
    real = security.hmac.compare_digest

    def spy(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    keys = tuple(k.encode() for k in ("a1", "b2", "c3"))
    assert security.constant_time_in("a1", keys) == 0
    assert len(calls) == 3  # no early exit on a match
    assert security.constant_time_in("zz", keys) is None
    assert security.constant_time_in("\udcff", keys) is None  # not even UTF-8


def test_keys_from_env_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nfile-key-1\n\n  file-key-2  \n")
    cfg = AuthConfig(api_keys_env="MY_KEYS", api_keys_file=str(f))
    keys = security.load_api_keys(cfg, {"MY_KEYS": "env-a, env-b,,"})
    assert keys == (b"env-a", b"env-b", b"file-key-1", b"file-key-2")
    assert security.load_api_keys(AuthConfig(), {}) == ()


async def test_api_keys_required_on_data_routes(start_app, start_router, monkeypatch):
    monkeypatch.setenv("KVROUTER_TEST_KEYS", ",".join(KEYS))
    up = FakeUpstream()
    _, url = await start_router([await start_app(up.app())], auth={"api_keys_env": "KVROUTER_TEST_KEYS"},
                                signals={"source": "health", "interval_s": 60})
    async with aiohttp.ClientSession() as client:
        for headers in ({}, bearer("nope"), bearer(KEYS[0] + "x"), {"Authorization": KEYS[0]},
                        {"Authorization": f"Basic {KEYS[0]}"}):
            for method, path in (("POST", "/v1/chat/completions"), ("POST", "/generate"), ("GET", "/v1/models"),
                                 ("GET", "/nope")):
                async with client.request(method, url + path, json=CHAT, headers=headers) as r:
                    assert r.status == 401
                    err = (await r.json())["error"]
                    assert err["type"] == "invalid_request_error" and err["code"] == 401
        for path in ("/health", "/ready", "/metrics"):
            async with client.get(url + path) as r:
                assert r.status == 200
        async with client.get(url + "/metrics") as r:
            assert 'kvrouter_auth_rejections_total{reason="invalid_key"} 20.0' in await r.text()
        for key in KEYS:
            async with client.post(url + "/v1/chat/completions", json=CHAT, headers=bearer(key)) as r:
                assert r.status == 200
            async with client.get(url + "/v1/models", headers=bearer(key)) as r:
                assert r.status == 200
    assert len(up.requests) == 2
    assert all("authorization" not in req["headers"] for req in up.requests)  # client keys stay here


@pytest.mark.fault_matrix(
    fault="One API key exceeds its concurrency limit",
    clients_saw="429 + Retry-After (OpenAI-shaped rate_limit_error) for that key only; others unaffected",
)
async def test_per_key_concurrency_limit_429(start_app, start_router, monkeypatch, fault_record):
    monkeypatch.setenv("KVROUTER_TEST_KEYS", ",".join(KEYS))
    hold = asyncio.Event()
    up = FakeUpstream(chunks=3, hold_after_first=hold)
    _, url = await start_router([await start_app(up.app())],
                                auth={"api_keys_env": "KVROUTER_TEST_KEYS", "max_concurrent_per_key": 2,
                                      "retry_after_s": 2},
                                signals={"source": "health", "interval_s": 60})
    stream = {**CHAT, "stream": True}
    async with aiohttp.ClientSession() as client:
        held_reqs = [fault_record.send("held") for _ in range(2)]
        held = [await client.post(url + "/v1/chat/completions", json=stream, headers=bearer(KEYS[0]))
                for _ in range(2)]
        firsts = [await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5) for r in held]
        limited = 0
        for _ in range(3):
            async with client.post(url + "/v1/chat/completions", json=stream, headers=bearer(KEYS[0])) as r:
                outcome = await fault_record.observe(r)
                assert (outcome.kind, outcome.status, outcome.retry_after) == ("clean_error", 429, "2")
                assert (await r.json())["error"]["type"] == "rate_limit_error"
                limited += 1
        other_req = fault_record.send("other key")
        other = await client.post(url + "/v1/chat/completions", json=stream, headers=bearer(KEYS[1]))
        assert other.status == 200
        hold.set()
        results = [req.got(await read_outcome(r, first)).kind
                   for req, r, first in zip([*held_reqs, other_req], [*held, other], [*firsts, b""])]
        assert results == ["complete"] * 3
        async with client.post(url + "/v1/chat/completions", json=CHAT, headers=bearer(KEYS[0])) as r:
            assert (await fault_record.observe(r)).kind == "complete"  # slots given back when the streams ended
        async with client.get(url + "/metrics") as r:
            assert f'kvrouter_auth_rejections_total{{reason="key_concurrency"}} {float(limited)}' in await r.text()
    fault_record.replica(fake_counts("replica", up))


async def test_upstream_credentials_injected_never_logged_or_echoed(start_app, start_router, monkeypatch, caplog):
    monkeypatch.setenv("KVROUTER_UPSTREAM_KEY", UPSTREAM_SECRET)
    caplog.set_level(logging.DEBUG)
    up = FakeUpstream()
    busy = FakeUpstream(status=503)
    urls = [await start_app(up.app()), await start_app(busy.app())]
    router, url = await start_router(urls, upstream={"api_key_env": "KVROUTER_UPSTREAM_KEY", "max_attempts": 1},
                                     signals={"source": "health", "interval_s": 0.05},
                                     policy={"name": "round_robin"})
    seen: list[bytes] = []
    async with aiohttp.ClientSession() as client:
        for body in (CHAT, {**CHAT, "stream": True}, b"{bad json", {**CHAT, "stream": True}):
            kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with client.post(url + "/v1/chat/completions", headers=bearer("client-key"), **kwargs) as r:
                seen.append(str(dict(r.headers)).encode() + await r.read())
        for path in ("/v1/models", "/metrics", "/ready", "/nope"):
            async with client.get(url + path) as r:
                seen.append(str(dict(r.headers)).encode() + await r.read())
        await asyncio.sleep(0.2)  # some health polls (which carry the key too)
    got = [req["headers"].get("authorization") for req in up.requests + busy.requests]
    assert got and all(g == f"Bearer {UPSTREAM_SECRET}" for g in got)  # the client's key replaced
    assert not any(UPSTREAM_SECRET.encode() in s for s in seen)
    assert UPSTREAM_SECRET not in caplog.text
    assert UPSTREAM_SECRET not in router.metrics.render().decode()


def test_log_redaction_of_urls_and_tokens(caplog):
    logger = logging.getLogger("kvrouter.test-redact")
    handler = logging.StreamHandler()
    security.install_log_redaction(logger)  # no handler yet: nothing to do
    logger.addHandler(handler)
    security.install_log_redaction(logger)
    assert any(isinstance(f, security.RedactingFilter) for f in handler.filters)
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "connect %s then %s", (
        "rediss://default:hunter2@redis.internal:6380/0", "Authorization: Bearer abc.def"), None)
    security.RedactingFilter().filter(rec)
    assert "hunter2" not in rec.getMessage() and "abc.def" not in rec.getMessage()
    assert "rediss://default:***@redis.internal:6380/0" in rec.getMessage()
    assert security.redact_url("redis://:pw@127.0.0.1:1/0") == "redis://:***@127.0.0.1:1/0"
    assert security.redact_url("redis://127.0.0.1:1/0") == "redis://127.0.0.1:1/0"
    logger.removeHandler(handler)
