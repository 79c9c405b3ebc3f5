"""The replica set at run time (router/membership.py) against a real registry, engine and
metrics, no HTTP; and discovery driving it through the `ReplicaMembership` protocol."""

from __future__ import annotations

import random

from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.policies.registry import build_policy
from kvrouter.router.config import parse_config
from kvrouter.router.discovery import Discovery
from kvrouter.router.engine import RoutingEngine
from kvrouter.router.kv_index_shadow import ShadowKVIndex
from kvrouter.router.membership import Membership, ReplicaMembership
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.router.sessions import SessionTable

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def membership(replicas: list[str], policy: str = "round_robin") -> tuple[Membership, list[str]]:
    config = parse_config({"replicas": replicas, "policy": {"name": policy}})
    engine = RoutingEngine(build_policy(policy, {}), ReplicaRegistry(config.replicas), ShadowKVIndex(),
                           SessionTable(), random.Random(0), metrics=RouterMetrics())
    forgotten: list[str] = []
    return Membership(config, engine, engine.metrics, lambda: 5.0,
                      forget_connections=forgotten.append), forgotten


def healthy_gauge(m: Membership, url: str) -> float | None:
    return m.metrics.registry.get_sample_value("kvrouter_replica_healthy", {"replica": url})


def test_static_replicas_start_healthy_in_the_metrics():
    m, _ = membership([A])
    assert healthy_gauge(m, A) == 1


def test_add_is_fresh_and_idempotent():
    m, _ = membership([A])
    assert m.add(B)
    assert B in m.registry and m.registry.view(B).fresh
    assert m.engine.fresh_since[B] == 5.0  # the clock it was given
    assert healthy_gauge(m, B) == 1
    assert not m.add(B) and not m.add(A)


def test_remove_forgets_the_replica_everywhere():
    m, forgotten = membership([A, B])
    m.engine.index.record(B, (1, 2, 3))
    assert m.remove(B)
    assert B not in m.registry
    assert m.engine.index.match((1, 2, 3), 8) == {}
    assert healthy_gauge(m, B) is None  # its series are gone
    assert forgotten == [B]  # and the relay's idle connections to it
    assert not m.remove(B) and forgotten == [B]


def test_drain_keeps_it_until_its_requests_end():
    m, _ = membership([A, B])
    m.registry.dispatched(B, 100)  # one request in flight there
    assert m.drain(B) and m.is_draining(B) and not m.is_draining(A)
    assert not m.registry.view(B).healthy  # no new requests
    assert healthy_gauge(m, B) == 0
    assert m.remove_drained() == [] and B in m.registry
    m.registry.completed(B, 100)
    assert m.remove_drained() == [B]
    assert B not in m.registry and not m.is_draining(B)
    assert not m.drain(C)  # unknown


def test_reload_swaps_the_policy_and_the_configured_replicas():
    m, _ = membership([A, B])
    assert m.add(C)  # an operator's: not in the config file
    new = parse_config({"replicas": [A, "http://d:1"], "policy": {"name": "least_load"}})
    changes = m.reload(new)
    assert changes == ["policy -> least_load", "+http://d:1", f"-{B}"]
    assert m.engine.policy.name == "least_load"
    assert set(m.registry.urls()) == {A, C, "http://d:1"}
    assert m.config.policy.name == "least_load" and tuple(m.config.replicas) == (A, "http://d:1")
    assert m.reload(new) == []  # nothing left to change


def test_discovery_drains_through_the_membership_and_readds_a_returning_replica():
    m, _ = membership([A])
    members: ReplicaMembership = m
    d = Discovery(members, [])
    d.publish("file", [B])
    assert B in m.registry and d.owned == {B}
    m.registry.dispatched(B, 10)
    d.publish("file", [])
    assert m.is_draining(B)  # drained, not removed: its request finishes
    d.publish("file", [B])  # back while still draining: a fresh replica again
    assert not m.is_draining(B) and m.registry.view(B).healthy and m.registry.view(B).fresh
    assert A in m.registry  # the static one is never discovery's to remove
