"""Replica discovery: a watched file, DNS, and the Kubernetes EndpointSlice list/watch protocol
(against a local API server over TLS with service-account auth). Appearing replicas are added
fresh; vanished ones are drained: no new work, in-flight requests finish."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvrouter.router.app import Router
from kvrouter.router.config import ConfigError, parse_config
from kvrouter.router.discovery import Discovery, Endpoint, parse_replica_list
from kvrouter.router.discovery_config import DNSDiscoveryConfig, KubernetesDiscoveryConfig
from kvrouter.router.discovery_dns import DNSSource, address_url
from kvrouter.router.discovery_k8s import KubernetesSource

from .fake_k8s import FakeKubeAPI, endpoint_slice, self_signed_cert
from .fakes import FakeUpstream

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def until(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


class Sink:
    """A replica membership (router/membership.py `ReplicaMembership`) that records what
    discovery asks of it; a drained replica has nothing in flight, so it leaves at once."""

    def __init__(self) -> None:
        self.replicas: set[str] = set()
        self.log: list[str] = []

    def add(self, url: str) -> bool:
        if url in self.replicas:
            return False
        self.replicas.add(url)
        self.log.append("+" + url)
        return True

    def remove(self, url: str) -> bool:
        if url not in self.replicas:
            return False
        self.replicas.discard(url)
        self.log.append("-" + url)
        return True

    def drain(self, url: str) -> bool:
        return self.remove(url)

    def is_draining(self, url: str) -> bool:
        return False

    def reload(self, config) -> list[str]:
        raise AssertionError("discovery never reloads the config")


# -- config ------------------------------------------------------------------------------------
def test_discovery_config_is_strict_and_named():
    cfg = parse_config({"discovery": {"dns": {"name": "sglang.inference.svc", "port": 30000}}})
    assert cfg.discovery.enabled and cfg.discovery.dns.port == 30000
    with pytest.raises(ConfigError, match=r"discovery\.dns\.bogus: unknown key"):
        parse_config({"discovery": {"dns": {"name": "x", "bogus": 1}}})
    with pytest.raises(ConfigError, match=r"discovery\.kubernetes\.service"):
        parse_config({"discovery": {"kubernetes": {}}})
    assert not parse_config({}).discovery.enabled


def test_replica_list_file_formats():
    assert parse_replica_list("- http://a:1\n- http://b:2\n") == ["http://a:1", "http://b:2"]
    assert parse_replica_list('["http://a:1"]') == ["http://a:1"]  # JSON is YAML
    assert parse_replica_list("replicas: [http://a:1]") == ["http://a:1"]
    assert parse_replica_list("") == []
    for bad in ("- ftp://a", "other: 1", "just text", "- 3"):
        with pytest.raises(ValueError):
            parse_replica_list(bad)


# -- file --------------------------------------------------------------------------------------
async def test_file_discovery_adds_fresh_and_drains_without_cutting(start_app, start_router, tmp_path: Path):
    hold = asyncio.Event()
    a = FakeUpstream(name="a", chunks=3, hold_after_first=hold)
    b = FakeUpstream(name="b")
    url_a, url_b = await start_app(a.app()), await start_app(b.app())
    listing = tmp_path / "replicas.yaml"
    listing.write_text(f"- {url_a}\n")
    router, base = await start_router(
        [], policy={"name": "round_robin"},
        discovery={"file": {"path": str(listing), "interval_s": 0.05}},
    )
    await until(lambda: url_a in router.registry)
    assert router.registry.view(url_a).fresh  # appeared: fresh for the scale-out rule
    async with aiohttp.ClientSession() as client:
        inflight = await client.post(base + "/v1/chat/completions", json=CHAT)
        await asyncio.wait_for(inflight.content.readuntil(b"\n\n"), 5)  # streaming from a
        listing.write_text(f"replicas:\n  - {url_b}\n")  # a vanishes, b appears
        await until(lambda: url_b in router.registry)
        await until(lambda: url_a not in router.registry or not router.registry.view(url_a).healthy)
        for _ in range(4):  # no new work for a
            async with client.post(base + "/v1/chat/completions", json={**CHAT, "stream": False}) as r:
                assert r.status == 200 and r.headers["x-upstream"] == "b"
        hold.set()
        rest = await asyncio.wait_for(inflight.read(), 5)
        assert rest.endswith(b"data: [DONE]\n\n") and a.finished.is_set()  # drained, not cut
    await until(lambda: url_a not in router.registry, timeout=5)  # removed once idle
    # A broken file keeps the last good set and counts the error.
    listing.write_text("- not a url\n")
    await asyncio.sleep(0.2)
    assert url_b in router.registry
    assert router.metrics.discovery_errors.labels("file")._value.get() >= 1
    assert router.metrics.discovery_replicas.labels("file")._value.get() == 1


async def test_discovery_never_removes_static_replicas():
    sink = Sink()
    sink.add("http://static:1")
    d = Discovery(sink, [])
    d.publish("file", ["http://static:1", "http://new:1"])
    assert d.owned == {"http://new:1"}
    d.publish("file", [])
    assert sink.replicas == {"http://static:1"}
    # Two sources: the fleet is the union; a URL stays while any source lists it.
    d.publish("dns", ["http://x:1"])
    d.publish("kubernetes", ["http://x:1", "http://y:1"])
    d.publish("dns", [])
    assert sink.replicas == {"http://static:1", "http://x:1", "http://y:1"}


# -- DNS ---------------------------------------------------------------------------------------
async def test_dns_discovery_real_resolver_localhost():
    """The system resolver (the event loop's getaddrinfo), for real, on `localhost`."""
    sink = Sink()
    d = Discovery(sink, [])
    src = DNSSource(DNSDiscoveryConfig(name="localhost", port=30123, family="ipv4"), d.error)
    await src.poll(lambda urls: d.publish("dns", urls))
    assert sink.replicas == {"http://127.0.0.1:30123"}


async def test_dns_discovery_rescales_and_survives_failures():
    answers: list[object] = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "fd00::3"],
                             socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
                             ["10.0.0.2"]]
    seen: list[tuple[str, int, int]] = []

    async def resolve(name: str, port: int, family: int) -> list[str]:
        seen.append((name, port, family))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    sink = Sink()
    d = Discovery(sink, [])
    errors: list[str] = []
    cfg = DNSDiscoveryConfig(name="sglang.inference.svc.cluster.local", port=30000, scheme="http")
    src = DNSSource(cfg, lambda s, m: errors.append(m), resolve=resolve)
    publish = lambda urls: d.publish("dns", urls)  # noqa: E731
    await src.poll(publish)
    assert sink.replicas == {"http://10.0.0.1:30000", "http://10.0.0.2:30000"}
    await src.poll(publish)
    assert sink.replicas == {"http://10.0.0.2:30000", "http://[fd00::3]:30000"}
    await src.poll(publish)  # resolver failure: keep the last set
    assert sink.replicas == {"http://10.0.0.2:30000", "http://[fd00::3]:30000"} and errors
    await src.poll(publish)
    assert sink.replicas == {"http://10.0.0.2:30000"}
    assert seen[0] == ("sglang.inference.svc.cluster.local", 30000, socket.AF_UNSPEC)
    assert address_url("https", "fe80::1%eth0", 8443) == "https://[fe80::1]:8443"


# -- Kubernetes --------------------------------------------------------------------------------
@pytest.fixture
async def kube_api(tmp_path: Path, monkeypatch):
    """The fake API server over TLS, reached the in-cluster way: KUBERNETES_SERVICE_HOST/PORT
    and a service-account directory with token, ca.crt and namespace."""
    pair = self_signed_cert(tmp_path)
    if pair is None:
        pytest.skip("openssl CLI not available: cannot make the API server's TLS certificate")
    cert, key = pair
    api = FakeKubeAPI()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    runner = web.AppRunner(api.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    port = runner.addresses[0][1]
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(api.token + "\n")
    (sa / "ca.crt").write_bytes(cert.read_bytes())
    (sa / "namespace").write_text(api.namespace)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
    yield api, sa
    await runner.cleanup()


async def test_kubernetes_list_watch_relist(kube_api):
    api, sa = kube_api
    api.slices["sglang-a"] = endpoint_slice("sglang-a", "sglang", ["10.1.0.1", "10.1.0.2"])
    router = Router(parse_config({"policy": {"name": "round_robin"}}))
    discovery = Discovery(router.membership, [], router.metrics)
    source = KubernetesSource(
        KubernetesDiscoveryConfig(service="sglang", port_name="http", service_account_dir=str(sa),
                                  retry_interval_s=0.05),
        discovery.error,
    )
    assert source.api.startswith("https://127.0.0.1:") and source.namespace == "inference"
    discovery.sources = [source]
    discovery.start()
    try:
        u1, u2, u3 = "http://10.1.0.1:30000", "http://10.1.0.2:30000", "http://10.1.0.3:30000"
        await until(lambda: {u1, u2} <= set(router.registry.urls()))
        assert api.lists == 1
        await until(lambda: len(api.watches) == 1)
        assert api.watches[0]["resourceVersion"] == "100"  # the list's resourceVersion
        assert api.watches[0]["allowWatchBookmarks"] == "true"

        # ADDED: a new slice (scale-out) -> a fresh replica.
        api.push("ADDED", endpoint_slice("sglang-b", "sglang", ["10.1.0.3"]))
        await until(lambda: u3 in router.registry)
        assert router.registry.view(u3).fresh
        # MODIFIED: 10.1.0.2 terminating (ready=false) -> drained, no new work.
        api.push("MODIFIED", endpoint_slice("sglang-a", "sglang", ["10.1.0.1", "10.1.0.2"],
                                            ready={"10.1.0.2": False}))
        await until(lambda: u2 not in router.registry or not router.registry.view(u2).healthy)
        # BOOKMARK moves the resourceVersion on without changes.
        api.push("BOOKMARK", {"kind": "EndpointSlice", "metadata": {}})
        # DELETED: slice b gone -> 10.1.0.3 drained.
        api.push("DELETED", endpoint_slice("sglang-b", "sglang", ["10.1.0.3"]))
        await until(lambda: u3 not in discovery.owned)
        assert source.resource_version == str(api.resource_version)

        # ERROR 410 mid-watch: relist and apply the difference (c appears, a's 10.1.0.1 stays).
        api.slices["sglang-c"] = endpoint_slice("sglang-c", "sglang", ["10.1.0.4"], rv=1)
        api.resource_version += 1
        watches = len(api.watches)
        api.push_gone()
        u4 = "http://10.1.0.4:30000"
        await until(lambda: api.lists == 2 and u4 in router.registry)
        assert discovery.owned == {u1, u4}

        # A non-410 watch error is counted and the watch resumed; the API answers that resumed
        # watch with HTTP 410 itself: relist again.
        await until(lambda: len(api.watches) > watches)  # the watch after the relist is open
        api.compacted_before = 10**9
        api.events.put_nowait({"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "boom"}})
        await until(lambda: api.lists >= 3, timeout=5)
        assert api.unauthorized == 0  # every request carried the service-account token
        assert router.metrics.discovery_errors.labels("kubernetes")._value.get() >= 1  # the 500
    finally:
        await discovery.close()


def test_endpoint_slice_ports_and_families(tmp_path: Path):
    (tmp_path / "namespace").write_text("ns")
    src = KubernetesSource(
        KubernetesDiscoveryConfig(service="s", service_account_dir=str(tmp_path),
                                  api_server="http://127.0.0.1:1", port_name="metrics"),
        lambda s, m: None,
    )
    def urls(obj) -> set[str]:
        return {e.url for e in src.slice_urls(obj)}

    obj = endpoint_slice("x", "s", ["fd00::1"], address_type="IPv6", port=9000, port_name="metrics")
    assert urls(obj) == {"http://[fd00::1]:9000"}
    obj["ports"][0]["name"] = "other"
    assert urls(obj) == set()  # the named port is not in this slice
    del obj["endpoints"][0]["conditions"]  # no conditions: ready (API semantics)
    src.config = src.config.model_copy(update={"port_name": None})
    assert urls(obj) == {"http://[fd00::1]:9000"}
    # a bootstrap port listed first is never the HTTP port; a colocated fleet's endpoints have no role
    obj = endpoint_slice("y", "s", ["10.0.0.1"], bootstrap_port=8998)
    assert src.slice_urls(obj) == {Endpoint("http://10.0.0.1:30000")}
    with pytest.raises(ValueError, match="namespace"):
        KubernetesSource(KubernetesDiscoveryConfig(service="s", service_account_dir=str(tmp_path / "no"),
                                                   api_server="http://x"), lambda s, m: None)
