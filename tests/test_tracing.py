"""OpenTelemetry tracing (router/tracing.py) against a real OTLP/HTTP receiver on loopback: the
request, decision and upstream spans, their attributes, and the W3C traceparent the replica gets."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from kvrouter.router.app import Router
from kvrouter.router.config import ConfigError, ObservabilityConfig, parse_config
from kvrouter.router.tracing import wanted

CHAT = "/v1/chat/completions"


def otlp_receiver() -> tuple[web.Application, list[Any]]:
    """An OTLP/HTTP trace receiver: decodes each protobuf export and keeps its spans."""
    spans: list[Any] = []

    async def traces(request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource in export.resource_spans:
            service = {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]
            for scope in resource.scope_spans:
                spans.extend((service, s) for s in scope.spans)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    return app, spans


def upstream() -> tuple[web.Application, list[dict[str, str]]]:
    """A replica that records the headers it gets and answers with usage."""
    seen: list[dict[str, str]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        await request.read()
        body = {"id": "c", "object": "chat.completion", "choices": [],
                "usage": {"prompt_tokens": 20, "completion_tokens": 2,
                          "prompt_tokens_details": {"cached_tokens": 0}}}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    app = web.Application()
    app.router.add_post(CHAT, chat)
    return app, seen


def attrs(span: Any) -> dict[str, Any]:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value"))
    return out


async def wait_for_spans(router: Router, spans: list[Any], n: int) -> None:
    deadline = time.monotonic() + 10.0
    while len(spans) < n:
        assert time.monotonic() < deadline, f"{len(spans)} spans exported, want {n}"
        assert router.tracing is not None
        await asyncio.to_thread(router.tracing.flush)  # the exporter posts from its own thread


async def test_spans_reach_an_otlp_receiver_and_traceparent_reaches_the_replica(start_app, start_router) -> None:
    receiver_app, spans = otlp_receiver()
    collector = await start_app(receiver_app)
    up_app, seen = upstream()
    replica = await start_app(up_app)
    router, url = await start_router(
        [replica], observability={"otel_endpoint": collector, "otel_service_name": "router-under-test"},
        routing={"shadow": ["consistent-hash"]})
    client_trace = "0af7651916cd43dd8448eb211c80319c"
    async with aiohttp.ClientSession() as s:
        async with s.post(url + CHAT, json={"model": "m", "messages": [{"role": "user", "content": "x" * 600}]},
                          headers={"traceparent": f"00-{client_trace}-b7ad6b7169203331-01",
                                   "x-session-id": "abc"}) as r:
            assert r.status == 200
    await wait_for_spans(router, spans, 3)
    by_name = {s.name: (service, s) for service, s in spans}
    assert set(by_name) == {f"POST {CHAT}", "kvrouter.route", "kvrouter.upstream"}
    assert {service for service, _ in spans} == {"router-under-test"}
    root, route, up = (by_name[n][1] for n in (f"POST {CHAT}", "kvrouter.route", "kvrouter.upstream"))
    # one trace, the client's; the decision and the exchange are children of the request
    assert {s.trace_id.hex() for s in (root, route, up)} == {client_trace}
    assert root.parent_span_id.hex() == "b7ad6b7169203331"
    assert route.parent_span_id == up.parent_span_id == root.span_id
    decision = attrs(route)
    assert decision["kvrouter.policy"] == "coding_agent" and decision["kvrouter.replica"] == replica
    assert decision["kvrouter.reason"] and decision["kvrouter.candidates"] == 1
    assert decision["kvrouter.predicted_cached_tokens"] == 0 and decision["kvrouter.predicted_ttft_s"] > 0
    assert decision["kvrouter.shadow.consistent-hash"] == replica
    exchange = attrs(up)
    assert exchange["http.response.status_code"] == 200 and exchange["kvrouter.reported_cached_tokens"] == 0
    assert attrs(root)["http.response.status_code"] == 200
    # the replica got the upstream span's context, in the client's trace
    (headers,) = seen
    version, trace_id, parent, flags = headers["traceparent"].split("-")
    assert (trace_id, parent) == (client_trace, up.span_id.hex())


async def test_a_failed_attempt_is_an_error_span_and_the_retry_a_second_decision(
    start_app, start_router, closed_port_url
) -> None:
    receiver_app, spans = otlp_receiver()
    collector = await start_app(receiver_app)
    up_app, _ = upstream()
    replica = await start_app(up_app)
    router, url = await start_router([closed_port_url, replica], observability={"otel_endpoint": collector},
                                     policy={"name": "round-robin"})
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # round robin: one of the two starts on the dead replica
            async with s.post(url + CHAT, json={"model": "m", "messages": []}) as r:
                assert r.status == 200
    # a request's spans all end before its root span: both roots exported means all spans were
    deadline = time.monotonic() + 10.0
    while sum(s.name == f"POST {CHAT}" for _, s in spans) < 2:
        assert time.monotonic() < deadline
        await asyncio.to_thread(router.tracing.flush)
    routes = [attrs(s) for _, s in spans if s.name == "kvrouter.route"]
    retries = sum(a["kvrouter.attempt"] == 2 for a in routes)
    assert retries >= 1 and sum(a["kvrouter.attempt"] == 1 for a in routes) == 2
    failed = [s for _, s in spans if s.name == "kvrouter.upstream" and s.status.code == 2]  # ERROR
    assert len(failed) == retries  # each retry follows one failed exchange, on the dead replica
    assert {attrs(s)["server.address"] for s in failed} == {closed_port_url}
    assert {attrs(s)["error.type"] for s in failed} == {"connect"}


def test_tracing_is_off_unless_an_endpoint_is_given() -> None:
    off = ObservabilityConfig()
    assert not wanted(off, {})
    assert wanted(off, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not wanted(ObservabilityConfig(otel_endpoint="http://x:4318"), {"OTEL_SDK_DISABLED": "true"})
    router = Router(parse_config({"replicas": ["http://127.0.0.1:1"]}))
    assert router.tracing is None and router.relay.tracing is None and not router.engine.explain


def test_endpoint_without_the_extra_is_a_config_error(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_otel_sdk(name: str, *args: Any, **kw: Any) -> Any:
        if name.startswith("opentelemetry.sdk") or name.startswith("opentelemetry.exporter"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_otel_sdk)
    with pytest.raises(ConfigError, match=r"observability.otel_endpoint: tracing needs the otel extra"):
        Router(parse_config({"replicas": ["http://127.0.0.1:1"],
                             "observability": {"otel_endpoint": "http://127.0.0.1:4318"}}))
