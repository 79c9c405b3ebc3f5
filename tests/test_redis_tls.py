"""Affinity over rediss://: server verified against a private CA, mutual TLS, and a wrong CA refused."""

from __future__ import annotations

import logging
import ssl

import aiohttp
import pytest
import redis.asyncio as aioredis
import trustme

from .fakes import FakeUpstream
from .fault_ledger import fake_counts
from .redis_server import TEST_PASSWORD as PASSWORD
from .redis_server import RedisProcess
from .tls_terminator import TLSTerminator

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
QUIET = {"source": "health", "interval_s": 60}


@pytest.fixture
def pki(tmp_path):
    """A private CA, a server certificate for 127.0.0.1 and a client certificate, as files."""
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    client_cert = ca.issue_cert("kvrouter-client")
    files = {"ca": tmp_path / "ca.pem", "client": tmp_path / "client.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    return ca, server_cert, files


def _server_context(ca: trustme.CA, cert: trustme.LeafCert, require_client_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    if require_client_cert:
        ca.configure_trust(ctx)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


async def _requests(url: str, sessions: list[str], record=None) -> list[int]:
    """One chat request per session; with ``record`` (a fault ledger) each one is recorded."""
    statuses = []
    async with aiohttp.ClientSession() as client:
        for s in sessions:
            async with client.post(url + "/v1/chat/completions", json=CHAT, headers={"x-session-id": s}) as r:
                if record is not None:
                    await record.observe(r)
                statuses.append(r.status)
    return statuses


async def _stored_home(redis_auth: RedisProcess, key: str) -> bytes | None:
    r = aioredis.Redis.from_url(redis_auth.url)
    try:
        return await r.hget(key, "home")
    finally:
        await r.aclose()


async def test_affinity_over_mutual_tls(start_app, start_router, redis_auth, pki, caplog):
    caplog.set_level(logging.DEBUG)
    ca, server_cert, files = pki
    tls = TLSTerminator(redis_auth.port, _server_context(ca, server_cert, require_client_cert=True))
    await tls.start()
    try:
        replica = await start_app(FakeUpstream().app())
        url = (f"rediss://:{PASSWORD}@127.0.0.1:{tls.port}/0?ssl_cert_reqs=required"
               f"&ssl_ca_certs={files['ca']}&ssl_certfile={files['client']}")
        router, base = await start_router([replica], affinity={"store": "redis", "redis_url": url,
                                                               "key_prefix": "tls:"}, signals=QUIET)
        assert await _requests(base, ["t1", "t2", "t1"]) == [200, 200, 200]
        assert not router.affinity.degraded
        assert tls.sessions >= 1
        assert await _stored_home(redis_auth, router.affinity._key("t1")) == replica.encode()
        assert PASSWORD not in caplog.text
    finally:
        await tls.stop()


@pytest.mark.fault_matrix(
    fault="Redis TLS endpoint whose certificate the router does not trust",
    clients_saw="every request 200 on local affinity (degraded flag set); nothing stored in Redis",
)
async def test_untrusted_redis_certificate_is_refused_and_routing_degrades(start_app, start_router, redis_auth,
                                                                            pki, fault_record):
    ca, server_cert, _ = pki
    tls = TLSTerminator(redis_auth.port, _server_context(ca, server_cert, require_client_cert=False))
    await tls.start()
    try:
        upstream = FakeUpstream()
        replica = await start_app(upstream.app())
        # No ssl_ca_certs: the system trust store does not know the private CA.
        url = f"rediss://:{PASSWORD}@127.0.0.1:{tls.port}/0?ssl_cert_reqs=required"
        router, base = await start_router([replica], affinity={"store": "redis", "redis_url": url,
                                                               "key_prefix": "tls:"}, signals=QUIET)
        statuses = await _requests(base, [f"u{i}" for i in range(4)], fault_record)
        assert statuses == [200] * 4
        assert router.affinity.degraded
        assert tls.sessions == 0  # every handshake was refused by the router's client
        assert await _stored_home(redis_auth, router.affinity._key("u0")) is None
        fault_record.replica(fake_counts("replica", upstream))
    finally:
        await tls.stop()
