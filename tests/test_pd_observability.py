"""A prefill/decode-disaggregated request is observed like a plain one: its spans (decision, one
upstream span per half, each half getting its own `traceparent`), its decision-log line and its
counters, also when its pair is retried on the same prefill server; a client leaving
mid-stream frees both servers' in-flight slots, and a decode server that leaves mid-request
leaves no metric series behind. Real servers on 127.0.0.1 and a real OTLP/HTTP
receiver."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import aiohttp
from aiohttp import web

from kvrouter.loadtest.process_group import free_port

from .fakes import FakeUpstream
from .test_decision_log import wait_for_lines
from .test_pd_routing import _metric
from .test_tracing import attrs, otlp_receiver, wait_for_spans

CHAT = "/v1/chat/completions"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
HELLO = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _fails_first(fake: FakeUpstream, status: int) -> FakeUpstream:
    """`fake` answers its first inference request with `status` (its health stays good), the
    later ones as it would."""
    handle = fake.handle

    async def first_fails(request: web.Request) -> web.StreamResponse:
        fake.status = status if not fake.requests else 200
        try:
            return await handle(request)
        finally:
            fake.status = 200

    fake.handle = first_fails  # type: ignore[method-assign]  # app() routes to it
    return fake


class _Prefer(random.Random):
    """A decode pool's rng that breaks its ties in favour of one server."""

    def __init__(self, url: str) -> None:
        super().__init__(0)
        self.url = url

    def choice(self, seq: Any) -> Any:
        return next((v for v in seq if v.id == self.url), seq[0])


async def _pd_fakes(
    start_app, decode: FakeUpstream | None = None, prefill: FakeUpstream | None = None
) -> tuple[FakeUpstream, FakeUpstream, dict[str, Any]]:
    """A prefill and a decode fake, and the router's `disaggregation` section for them."""
    p_fake, d_fake = prefill or FakeUpstream("prefill"), decode or FakeUpstream("decode")
    p_url, d_url = await start_app(p_fake.app()), await start_app(d_fake.app())
    return p_fake, d_fake, {"prefill": [f"{p_url}={free_port()}"], "decode": [d_url]}


def _parent(headers: dict[str, str]) -> tuple[str, str]:
    """(trace id, parent span id) of a request's `traceparent`."""
    _, trace_id, parent, _ = headers["traceparent"].split("-")
    return trace_id, parent


async def test_a_pd_request_gets_a_decision_span_and_one_upstream_span_per_half(
    start_app, start_router
) -> None:
    receiver_app, spans = otlp_receiver()
    collector = await start_app(receiver_app)
    p_fake, d_fake, pd = await _pd_fakes(start_app)
    p_url, d_url = pd["prefill"][0].rsplit("=", 1)[0], pd["decode"][0]
    router, url = await start_router([], disaggregation=pd, observability={"otel_endpoint": collector},
                                     routing={"shadow": ["consistent-hash"]})
    async with aiohttp.ClientSession() as s:
        async with s.post(url + CHAT, json={"model": "m", "messages": [{"role": "user", "content": "x" * 600}]},
                          headers={"traceparent": f"00-{CLIENT_TRACE}-b7ad6b7169203331-01",
                                   "x-session-id": "abc"}) as r:
            assert r.status == 200
    await wait_for_spans(router, spans, 4)
    names = sorted(s.name for _, s in spans)
    assert names == sorted([f"POST {CHAT}", "kvrouter.route", "kvrouter.upstream", "kvrouter.upstream"])
    root = next(s for _, s in spans if s.name == f"POST {CHAT}")
    route = next(s for _, s in spans if s.name == "kvrouter.route")
    halves = {attrs(s)["kvrouter.pd_role"]: s for _, s in spans if s.name == "kvrouter.upstream"}
    assert set(halves) == {"prefill", "decode"}
    assert {s.trace_id.hex() for _, s in spans} == {CLIENT_TRACE}
    assert {route.parent_span_id, halves["prefill"].parent_span_id, halves["decode"].parent_span_id} == {
        root.span_id}
    decision = attrs(route)  # the prefill server is the policy's pick
    assert decision["kvrouter.policy"] == "coding_agent" and decision["kvrouter.replica"] == p_url
    assert decision["kvrouter.reason"] and decision["kvrouter.candidates"] == 1
    assert decision["kvrouter.predicted_cached_tokens"] == 0 and decision["kvrouter.predicted_ttft_s"] > 0
    assert decision["kvrouter.shadow.consistent-hash"] == p_url
    (p_req,), (d_req,) = p_fake.requests, d_fake.requests
    room = p_req["body"]["bootstrap_room"]
    for role, server, req in (("prefill", p_url, p_req), ("decode", d_url, d_req)):
        exchange = attrs(halves[role])
        assert exchange["server.address"] == server and exchange["kvrouter.bootstrap_room"] == room
        assert exchange["http.response.status_code"] == 200 and exchange["kvrouter.attempt"] == 1
        assert halves[role].status.code != 2  # not ERROR
        # each server gets its own half's context, in the client's trace
        assert _parent(req["headers"]) == (CLIENT_TRACE, halves[role].span_id.hex())
    assert attrs(halves["decode"])["kvrouter.ttfb_s"] > 0


async def test_a_pd_retry_on_the_same_prefill_server_counts_once_and_keeps_its_decision(
    start_app, start_router, tmp_path
) -> None:
    receiver_app, spans = otlp_receiver()
    collector = await start_app(receiver_app)
    p_fake, d_fake, pd = await _pd_fakes(start_app)
    p_url, d_url = pd["prefill"][0].rsplit("=", 1)[0], pd["decode"][0]
    refusing = _fails_first(FakeUpstream("refusing"), 503)
    pd["decode"].append(await start_app(refusing.app()))
    path = tmp_path / "decisions.jsonl"
    router, url = await start_router(
        [], disaggregation=pd, upstream={"max_attempts": 3}, admission={"queue": True},
        routing={"shadow": ["consistent-hash"]},
        observability={"decision_log": str(path), "otel_endpoint": collector})
    assert router.decode_pool is not None
    router.decode_pool.rng = _Prefer(pd["decode"][1])  # the pair's first decode half is refused
    released: list[tuple[str, bool]] = []
    ttfts: list[tuple[float, float]] = []
    engine = router.engine
    on_release, on_first_byte = engine.on_release, engine.on_first_byte
    assert on_release is not None and on_first_byte is not None  # admission's
    engine.on_release = lambda u, served: (released.append((u, served)), on_release(u, served))
    engine.on_first_byte = lambda p, o: (ttfts.append((p, o)), on_first_byte(p, o))
    async with aiohttp.ClientSession() as s:
        async with s.post(url + CHAT, json={"model": "m", "stream": True,
                                            "messages": [{"role": "user", "content": "y" * 900}]}) as r:
            assert r.status == 200
            await r.read()
    # the decode half refused: the pair was retried on the same prefill server, another decode server
    assert len(p_fake.requests) == 2 and len(refusing.requests) == 1 and len(d_fake.requests) == 1
    [line] = await wait_for_lines(path, 1)
    assert line["replica"] == p_url and line["decode"] == d_url and line["attempts"] == 2
    assert line["policy"] == "coding_agent" and line["predicted_cached"] == 0
    assert line["predicted_ttft_s"] is not None and "consistent-hash" in line["shadow"]
    assert "error" not in line and line["status"] == 200
    # the prompt is counted once; admission saw one request served, and calibrated its TTFT once
    assert await _metric(url, "kvrouter_prompt_tokens_total") == line["prompt_tokens"] > 0
    assert released == [(p_url, False), (p_url, True)]
    assert len(ttfts) == 1 and round(ttfts[0][1], 6) == line["ttft_s"]
    # two decisions traced, the retry's with the same notes; the refused decode half is an error
    deadline = time.monotonic() + 10.0
    while not any(s.name == f"POST {CHAT}" for _, s in spans):
        assert time.monotonic() < deadline
        await asyncio.to_thread(router.tracing.flush)
    routes = sorted((attrs(s) for _, s in spans if s.name == "kvrouter.route"),
                    key=lambda a: a["kvrouter.attempt"])
    assert [a["kvrouter.attempt"] for a in routes] == [1, 2]
    assert all(a["kvrouter.policy"] == "coding_agent" and a["kvrouter.shadow.consistent-hash"] for a in routes)
    failed = [attrs(s) for _, s in spans if s.name == "kvrouter.upstream" and s.status.code == 2]
    assert [(a["kvrouter.pd_role"], a["http.response.status_code"], a["kvrouter.attempt"]) for a in failed] == [
        ("decode", 503, 1)]


async def test_a_client_leaving_mid_stream_frees_both_servers_slots(start_app, start_router) -> None:
    hold = asyncio.Event()  # never set: the decode server streams one chunk, then waits
    p_fake, d_fake, pd = await _pd_fakes(start_app, FakeUpstream("decode", hold_after_first=hold))
    p_url, d_url = pd["prefill"][0].rsplit("=", 1)[0], pd["decode"][0]
    router, url = await start_router([], disaggregation=pd)
    assert router.decode_pool is not None
    prefill_views, decode_views = router.engine.registry, router.decode_pool.registry
    async with aiohttp.ClientSession() as s:
        r = await s.post(url + CHAT, json={"model": "m", "stream": True,
                                           "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 200
        assert await r.content.readany()  # the first event is relayed
        assert prefill_views.snapshot().get(p_url).in_flight == 1
        assert decode_views.snapshot().get(d_url).in_flight == 1
        r.close()  # the client goes away mid-stream
    await asyncio.wait_for(d_fake.disconnected.wait(), 10.0)  # the decode server's request is aborted
    deadline = time.monotonic() + 10.0
    while prefill_views.snapshot().get(p_url).in_flight or decode_views.snapshot().get(d_url).in_flight:
        assert time.monotonic() < deadline, "an in-flight slot was not released"
        await asyncio.sleep(0.01)
    assert await _metric(url, "kvrouter_replica_in_flight_requests") == 0


async def test_a_decode_server_removed_mid_request_leaves_no_series_behind(start_app, start_router) -> None:
    hold = asyncio.Event()  # the decode server streams one chunk, waits, then breaks off
    _, _, pd = await _pd_fakes(start_app, FakeUpstream("decode", hold_after_first=hold, die_after_chunks=2))
    d_url = pd["decode"][0]
    router, url = await start_router([], disaggregation=pd)
    assert router.decode_pool is not None
    async with aiohttp.ClientSession() as s:
        async with s.post(url + CHAT, json={"model": "m", "stream": True,
                                            "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200
            assert await r.content.readany()
            assert router.decode_pool.remove(d_url)  # a reload or discovery drops it now
            hold.set()
            rest = await r.read()
    assert b"mid-stream" in rest  # the stream ended with the router's error event
    async with aiohttp.ClientSession() as s:
        text = await (await s.get(url + "/metrics")).text()
    assert d_url not in text  # its upstream error, counted after it left, went with it


async def test_a_pair_whose_decode_half_fails_is_no_completion_for_admission(start_app, start_router) -> None:
    p_fake, _, pd = await _pd_fakes(start_app, _fails_first(FakeUpstream("decode"), 500))
    p_url = pd["prefill"][0].rsplit("=", 1)[0]
    router, url = await start_router([], disaggregation=pd, upstream={"max_attempts": 1})
    released: list[tuple[str, bool]] = []
    router.engine.on_release = lambda u, served: released.append((u, served))
    async with aiohttp.ClientSession() as s:
        async with s.post(url + CHAT, json=HELLO) as r:
            assert r.status == 500  # the last attempt's decode answer, relayed
    assert len(p_fake.requests) == 1  # the prefill half served its part...
    assert released == [(p_url, False)]  # ...but the request was not served


async def test_a_client_error_from_the_prefill_server_is_no_bootstrap_failure(start_app, start_router) -> None:
    p_fake, d_fake, pd = await _pd_fakes(start_app, prefill=FakeUpstream("prefill", status=400))
    _, url = await start_router([], disaggregation=pd)
    async with aiohttp.ClientSession() as s:
        async with s.post(url + CHAT, json=HELLO) as r:
            assert r.status == 400  # relayed as it is
    assert len(p_fake.requests) == 1 and len(d_fake.requests) <= 1
    assert await _metric(url, "kvrouter_pd_bootstrap_failures_total") == 0
    assert await _metric(url, "kvrouter_upstream_retries_total") == 0
