"""Discovering a prefill/decode-disaggregated fleet: endpoints carry a role (a file entry's
`role:`, a Kubernetes endpoint's Service), decode servers join the decode pool, prefill servers
the routed pool with their bootstrap port. Real simulated PD replicas on 127.0.0.1 and the
local Kubernetes API stand-in."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import openai
import pytest

from kvrouter.loadtest.process_group import free_port
from kvrouter.loadtest.sim_disagg import Disaggregation
from kvrouter.loadtest.sim_server import SIM_KEY, build_app
from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.router.app import Router
from kvrouter.router.config import ConfigError, parse_config
from kvrouter.router.decode_pool import DecodePool, DiscoveredPDFleet
from kvrouter.router.discovery import Discovery, Endpoint, parse_replica_list
from kvrouter.router.discovery_config import KubernetesDiscoveryConfig
from kvrouter.router.discovery_k8s import KubernetesSource

from .fake_k8s import endpoint_slice
from .test_discovery import Sink, kube_api, until  # noqa: F401 - kube_api is a fixture

FAST = 200.0
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class PDSink:
    """A PD fleet's decode pool and bootstrap ports (router/discovery.py `PDMembership`)."""

    def __init__(self) -> None:
        self.decode: set[str] = set()
        self.ports: dict[str, int] = {}

    def add_decode(self, url: str) -> bool:
        if url in self.decode:
            return False
        self.decode.add(url)
        return True

    def remove_decode(self, url: str) -> bool:
        if url not in self.decode:
            return False
        self.decode.discard(url)
        return True

    def set_bootstrap_ports(self, ports: dict[str, int]) -> None:
        self.ports = dict(ports)


# -- config and file format ----------------------------------------------------------------------
def test_file_entries_carry_a_role_and_a_bootstrap_port():
    text = ("- http://p:1\n"
            "- {url: http://p:2, role: prefill, bootstrap_port: 9001}\n"
            "- {url: http://d:1, role: decode}\n")
    assert parse_replica_list(text) == [
        "http://p:1", Endpoint("http://p:2", "prefill", 9001), Endpoint("http://d:1", "decode")]
    for bad, message in [
        ("- {url: http://d:1, role: decoder}", "role 'decoder'"),
        ("- {url: http://d:1, role: decode, bootstrap_port: 9001}", "not a decode server's"),
        ("- {url: http://p:1, bootstrap_port: 70000}", "not a port number"),
        ("- {url: http://p:1, port: 1}", "unknown keys"),
        ("- {role: decode}", "needs a `url`"),
        ("- {url: ftp://x, role: decode}", "ftp"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_replica_list(bad)


def test_a_discovered_pd_fleet_needs_no_static_servers_but_a_source():
    cfg = parse_config({"disaggregation": {"from_discovery": True},
                        "discovery": {"file": {"path": "fleet.yaml"}}})
    assert cfg.disaggregation.enabled and cfg.replicas == ()
    with pytest.raises(ConfigError, match="needs a discovery source"):
        parse_config({"disaggregation": {"from_discovery": True}})
    with pytest.raises(ConfigError, match="decode_service must differ"):
        parse_config({"discovery": {"kubernetes": {"service": "s", "decode_service": "s"}}})


# -- merging -------------------------------------------------------------------------------------
def test_decode_endpoints_go_to_the_decode_pool_and_prefill_ports_to_the_relay():
    sink, pd = Sink(), PDSink()
    d = Discovery(sink, [], pd=pd)
    d.publish("file", ["http://p:1", Endpoint("http://p:2", "prefill", 9001), Endpoint("http://d:1", "decode")])
    assert sink.replicas == {"http://p:1", "http://p:2"} and pd.decode == {"http://d:1"}
    assert pd.ports == {"http://p:2": 9001}
    # A server that changes role moves between the pools; a vanished decode server leaves.
    d.publish("file", [Endpoint("http://p:2", "decode"), Endpoint("http://d:1", "prefill")])
    assert sink.replicas == {"http://d:1"} and pd.decode == {"http://p:2"} and pd.ports == {}
    # Two sources disagreeing on a role: the server is used as neither until they agree.
    d.publish("kubernetes", [Endpoint("http://p:2", "prefill", 9001)])
    assert "http://p:2" not in sink.replicas and pd.decode == set()
    d.publish("kubernetes", [])
    assert pd.decode == {"http://p:2"}


def test_a_colocated_router_ignores_endpoints_with_a_role_and_counts_it():
    router = Router(parse_config({"policy": {"name": "round_robin"}}))
    d = Discovery(router.membership, [], router.metrics)
    d.publish("file", ["http://a:1", Endpoint("http://d:1", "decode"), Endpoint("http://p:1", "prefill")])
    assert router.registry.urls() == ["http://a:1"]
    assert router.metrics.discovery_errors.labels("file")._value.get() == 1


def test_a_reload_keeps_the_discovered_decode_servers():
    pool = DecodePool(["http://d:1"], RouterMetrics(), random.Random(0))
    assert pool.add("http://d:2") and not pool.add("http://d:1")
    assert pool.set_urls(["http://d:3"]) == ["+decode http://d:3", "-decode http://d:1"]
    assert sorted(pool.registry.urls()) == ["http://d:2", "http://d:3"]


# -- end to end ----------------------------------------------------------------------------------
async def _sim(start_app, mode: str, seed: int, bootstrap_port: int = 8998):
    app = build_app("tiny", time_scale=FAST, seed=seed, disaggregation=Disaggregation(mode, bootstrap_port))
    return app[SIM_KEY], await start_app(app)


async def _ready(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
        return r.status


async def test_a_pd_fleet_discovered_from_a_file_serves_and_follows_the_file(start_app, start_router, tmp_path: Path):
    port = free_port()
    p_sim, p_url = await _sim(start_app, "prefill", 0, port)
    d1_sim, d1_url = await _sim(start_app, "decode", 100)
    d2_sim, d2_url = await _sim(start_app, "decode", 101)
    listing = tmp_path / "fleet.yaml"
    listing.write_text(f"- {{url: {p_url}, role: prefill, bootstrap_port: {port}}}\n"
                       f"- {{url: {d1_url}, role: decode}}\n")
    router, url = await start_router(
        [], disaggregation={"from_discovery": True}, signals={"interval_s": 0.05},
        discovery={"file": {"path": str(listing), "interval_s": 0.05}},
    )
    await until(lambda: p_url in router.registry)
    assert router.decode_pool is not None
    assert router.decode_pool.registry.urls() == [d1_url]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    answer = await client.chat.completions.create(**CHAT)  # the prefill server accepts its port
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert p_sim.model.num_requests_total == 1 and d1_sim.model.num_requests_total == 1
    # The file swaps the decode server: new requests go to the new one.
    listing.write_text(f"replicas:\n  - {{url: {p_url}, role: prefill, bootstrap_port: {port}}}\n"
                       f"  - {{url: {d2_url}, role: decode}}\n")
    await until(lambda: router.decode_pool.registry.urls() == [d2_url])
    await client.chat.completions.create(**CHAT)
    assert d2_sim.model.num_requests_total == 1 and d1_sim.model.num_requests_total == 1
    # No decode server left: not ready (the prefill pool alone cannot answer).
    listing.write_text(f"- {{url: {p_url}, role: prefill, bootstrap_port: {port}}}\n")
    await until(lambda: router.decode_pool.registry.urls() == [])
    for _ in range(250):  # bounded wait for the readiness to follow
        if await _ready(url) == 503:
            break
        await asyncio.sleep(0.02)
    assert await _ready(url) == 503


async def test_kubernetes_discovers_prefill_and_decode_services_in_one_watch(kube_api):  # noqa: F811
    api, sa = kube_api
    api.other_services = ("sglang-decode",)
    api.slices["p"] = endpoint_slice("p", "sglang", ["10.2.0.1"], bootstrap_port=9001)
    api.slices["d"] = endpoint_slice("d", "sglang-decode", ["10.2.0.2"])
    api.slices["x"] = endpoint_slice("x", "unrelated", ["10.2.0.9"])  # not selected
    router = Router(parse_config({"disaggregation": {"from_discovery": True},
                                  "discovery": {"file": {"path": "unused.yaml"}}}))
    assert router.decode_pool is not None and router.relay.pd is not None
    discovery = Discovery(router.membership, [], router.metrics,
                          DiscoveredPDFleet(router.decode_pool, router.relay.pd.discovered_ports))
    source = KubernetesSource(
        KubernetesDiscoveryConfig(service="sglang", decode_service="sglang-decode",
                                  service_account_dir=str(sa), retry_interval_s=0.05),
        discovery.error,
    )
    assert source.selector == "kubernetes.io/service-name in (sglang,sglang-decode)"
    discovery.sources = [source]
    discovery.start()
    try:
        p1, d1 = "http://10.2.0.1:30000", "http://10.2.0.2:30000"  # the bootstrap port is not HTTP
        await until(lambda: router.registry.urls() == [p1] and router.decode_pool.registry.urls() == [d1])
        assert router.relay.pd.bootstrap_port(p1) == 9001
        await until(lambda: len(api.watches) == 1)
        # Scale-out of the decode Service; an unrelated Service's event is not seen.
        api.push("ADDED", endpoint_slice("d2", "sglang-decode", ["10.2.0.3"]))
        api.push("ADDED", endpoint_slice("y", "unrelated", ["10.2.0.8"]))
        await until(lambda: "http://10.2.0.3:30000" in router.decode_pool.registry.urls())
        # A decode pod turns unready: it leaves the decode pool.
        api.push("MODIFIED", endpoint_slice("d", "sglang-decode", ["10.2.0.2"], ready={"10.2.0.2": False}))
        await until(lambda: router.decode_pool.registry.urls() == ["http://10.2.0.3:30000"])
        assert set(router.registry.urls()) == {p1}
    finally:
        api.push_gone()  # end the open watch (and any later one) for the teardown
        api.compacted_before = 10**9
        await until(lambda: api.events.empty())
        await discovery.close()
