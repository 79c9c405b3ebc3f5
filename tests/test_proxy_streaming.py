"""The relay against real aiohttp servers on 127.0.0.1: streaming, disconnects, retries."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from .fakes import FakeUpstream

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_chunks_reach_client_while_upstream_is_still_writing(start_app, start_router):
    hold = asyncio.Event()
    up = FakeUpstream(chunks=6, hold_after_first=hold)
    _, router_url = await start_router([await start_app(up.app())])
    received = b""
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
            # The upstream is blocked after chunk 0, so this chunk was relayed, not buffered.
            assert not up.finished.is_set()
            assert first == up.sent[0]
            hold.set()
            received = first + await resp.read()
    assert up.finished.is_set()
    assert received == b"".join(up.sent)  # byte-identical end to end, in order


async def test_client_disconnect_reaches_upstream(start_app, start_router):
    hold = asyncio.Event()  # never set: the upstream would wait forever
    up = FakeUpstream(chunks=50, hold_after_first=hold)
    router, router_url = await start_router([await start_app(up.app())])
    async with aiohttp.ClientSession() as client:
        resp = await client.post(router_url + "/v1/chat/completions", json=CHAT)
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(up.disconnected.wait(), 5)
    # The router's in-flight accounting is released too.
    for _ in range(50):
        if router.registry.snapshot().replicas[0].in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert router.registry.snapshot().replicas[0].in_flight == 0


async def test_refused_connection_is_retried_on_another_replica(
    start_app, start_router, closed_port_url
):
    up = FakeUpstream(name="good")
    # Round robin, and no background probes, so requests themselves meet the dead replica.
    _, router_url = await start_router(
        [closed_port_url, await start_app(up.app())],
        policy={"name": "round_robin"}, signals={"interval_s": 60},
    )
    async with aiohttp.ClientSession() as client:
        for _ in range(4):  # round robin hits the dead replica first half the time
            async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                assert resp.headers["x-upstream"] == "good"
                assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        metrics = await (await client.get(router_url + "/metrics")).text()
    assert 'kvrouter_upstream_retries_total{reason="connect"}' in metrics


async def test_503_before_first_byte_is_retried(start_app, start_router):
    busy = FakeUpstream(name="busy", status=503)
    good = FakeUpstream(name="good")
    _, router_url = await start_router(
        [await start_app(busy.app()), await start_app(good.app())],
        policy={"name": "round_robin"}, signals={"interval_s": 60},
    )
    async with aiohttp.ClientSession() as client:
        for _ in range(4):
            async with client.post(router_url + "/v1/chat/completions",
                                   json={**CHAT, "stream": False}) as resp:
                assert resp.status == 200
                assert resp.headers["x-upstream"] == "good"
    assert len(busy.requests) >= 1  # it was tried, and its 503 never reached the client


async def test_all_attempts_failing_gives_json_503(start_router, closed_port_url):
    _, router_url = await start_router([closed_port_url], upstream={"max_attempts": 2})
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"]
            err = (await resp.json())["error"]
            assert err["code"] == 503 and err["type"] == "service_unavailable" and err["message"]


async def test_failure_after_first_byte_ends_stream_with_clean_sse_error(start_app, start_router):
    up = FakeUpstream(chunks=10, die_after_chunks=3)
    _, router_url = await start_router([await start_app(up.app())])
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            body = await asyncio.wait_for(resp.read(), 10)
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    payloads = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]  # all whole JSON
    assert [p["object"] for p in payloads[:3]] == ["chat.completion.chunk"] * 3
    assert payloads[-1]["error"]["type"] == "upstream_error"


async def test_non_streaming_body_relayed_with_content_length(start_app, start_router):
    up = FakeUpstream()
    _, router_url = await start_router([await start_app(up.app())])
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/generate",
                               json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}) as resp:
            assert resp.status == 200
            assert resp.content_length is not None
            assert (await resp.json())["object"] == "chat.completion"
    assert up.requests[0]["path"] == "/generate"


async def test_retry_moves_a_new_sessions_home_to_the_replica_that_served_it(
    start_app, start_router, closed_port_url
):
    up = FakeUpstream(name="good")
    good = await start_app(up.app())
    router, router_url = await start_router(
        [closed_port_url, good], signals={"interval_s": 60},
        server={"host": "127.0.0.1", "port": 0, "replica_header": True},
    )
    async with aiohttp.ClientSession() as client:
        for i in range(6):  # some first attempts pick the dead replica, then retry on the good one
            key = f"retry-{i}"
            async with client.post(router_url + "/v1/chat/completions", json=CHAT,
                                   headers={"x-session-id": key}) as resp:
                assert resp.status == 200
                served = resp.headers["x-kvrouter-replica"]
            assert served == good
            assert router.table.entry(key).home == good  # its KV is there, so is its home


async def test_a_served_prompt_is_recorded_after_the_first_bytes_are_written(
        start_app, start_router, monkeypatch):
    """The KV index record of a long prompt costs up to milliseconds: it follows the first
    write to the client (it is not in the time to first token), and is in place while the
    stream goes on; a whole answer's is in place when the client has it."""
    from kvrouter.router import data_http

    events: list[str] = []
    write = data_http.StreamResponse.write

    async def logged_write(self, data: bytes) -> None:
        events.append("write")
        await write(self, data)

    monkeypatch.setattr(data_http.StreamResponse, "write", logged_write)
    hold = asyncio.Event()
    up = FakeUpstream(chunks=3, hold_after_first=hold)
    replica = await start_app(up.app())
    router, router_url = await start_router([replica])
    index = router.engine.index
    record = index.record
    monkeypatch.setattr(index, "record", lambda *args: (events.append("record"), record(*args)))
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "x" * 20_000}]}
    async with aiohttp.ClientSession() as client:
        async with client.post(router_url + "/v1/chat/completions", json=long_chat) as resp:
            assert resp.status == 200
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
            assert events[:2] == ["write", "record"]
            assert len(index.held_blocks(replica)) > 0  # held while the stream goes on
            hold.set()
            await resp.read()
        events.clear()
        whole = {**long_chat, "messages": [{"role": "user", "content": "y" * 20_000}], "stream": False}
        async with client.post(router_url + "/v1/chat/completions", json=whole) as resp:
            assert resp.status == 200
            await resp.read()
            assert events == ["record"]
        events.clear()
        up.chunks = 0  # a stream of its end alone: recorded all the same
        empty = {**long_chat, "messages": [{"role": "user", "content": "z" * 20_000}]}
        async with client.post(router_url + "/v1/chat/completions", json=empty) as resp:
            assert resp.status == 200
            await resp.read()
            assert "record" in events
