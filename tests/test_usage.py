"""Reading the usage replicas report: shapes as SGLang and the simulated replica send them, the
usage event the router asks for on a stream (and hides from the client), and usage that cannot
be read (counted, never breaking a response). Real servers on 127.0.0.1, the real openai client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from kvrouter.loadtest import sim_responses as out
from kvrouter.loadtest import tokenizer
from kvrouter.loadtest.sim_server import build_app
from kvrouter.router.usage import (
    UsageReport,
    ask_stream_usage,
    body_asking_stream_usage,
    from_body,
    from_meta_info,
    from_usage,
    last_generate_usage,
    take_usage_event,
)

CHAT = "/v1/chat/completions"


def _sample(router: Any, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


# -- shapes --------------------------------------------------------------------------------------
class _St:  # the fields sim_responses.usage reads
    prompt_len = 300
    cached_tokens = 128
    output_len = 7


def test_openai_usage_as_sglang_sends_it() -> None:
    assert from_usage(out.usage(_St(), enable_cache_report=True)) == UsageReport(300, 128, 7)
    # without --enable-cache-report prompt_tokens_details is null: prompt tokens only
    assert from_usage(out.usage(_St(), enable_cache_report=False)) == UsageReport(300, None, 7)
    assert from_meta_info({"prompt_tokens": 300, "cached_tokens": 128, "id": "x"}) == UsageReport(300, 128)
    assert from_meta_info({"prompt_tokens": 3, "completion_tokens": 2}) == UsageReport(3, None, 2)
    # output tokens are only logged: a bad count is left out, the usage still counts
    assert from_usage({"prompt_tokens": 3, "completion_tokens": "x"}) == UsageReport(3, None, None)


def test_unreadable_usage_gives_a_reason() -> None:
    assert from_usage(None) == "missing"
    assert from_usage({"completion_tokens": 3}) == "missing"
    assert from_usage("12") == "garbage"
    assert from_usage({"prompt_tokens": -1}) == "negative"
    assert from_usage({"prompt_tokens": "300"}) == "garbage"
    assert from_usage({"prompt_tokens": True}) == "garbage"
    assert from_usage({"prompt_tokens": 3.5}) == "garbage"
    assert from_usage({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": -2}}) == "negative"
    assert from_usage({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}}) == "garbage"
    assert from_usage({"prompt_tokens": 10, "prompt_tokens_details": [1]}) == "garbage"
    assert from_body(CHAT, b"{not json") == "garbage"
    assert from_body("/generate", b"[]") == "batch"
    assert from_meta_info(None) == "missing"


def test_usage_event_taken_out_only_when_the_router_asked() -> None:
    chunk = b'data: {"choices":[{"delta":{"content":"\\"choices\\":[]"}}],"usage":null}\n\n'
    usage_event = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":16}}}\n\n'
    done = b"data: [DONE]\n\n"
    # content quoting the marker is never a usage event (its quotes are escaped)
    assert take_usage_event(CHAT, chunk, drop=True) == (chunk, None)
    assert take_usage_event(CHAT, chunk + usage_event + done, drop=True) == (chunk + done, UsageReport(40, 16))
    assert take_usage_event(CHAT, usage_event + done, drop=False) == (usage_event + done, UsageReport(40, 16))
    crlf = usage_event.replace(b"\n\n", b"\r\n\r\n")
    assert take_usage_event(CHAT, crlf, drop=True) == (b"", UsageReport(40, 16))


def test_generate_stream_usage_from_its_last_event() -> None:
    ev = lambda n: b"data: " + orjson.dumps({"text": "x", "meta_info": {"prompt_tokens": 50, "cached_tokens": n}}) + b"\n\n"  # noqa: E731
    assert last_generate_usage(ev(0) + ev(32) + b"data: [DONE]\n\n") == UsageReport(50, 32)
    assert last_generate_usage(b"data: [DONE]\n\n") == "missing"


def test_ask_stream_usage_only_where_missing() -> None:
    body: dict[str, Any] = {"stream": True}
    assert ask_stream_usage(CHAT, body) and body["stream_options"] == {"include_usage": True}
    body = {"stream": True, "stream_options": {"continuous_usage_stats": False}}
    assert ask_stream_usage("/v1/completions", body)
    assert body["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert not ask_stream_usage(CHAT, {"stream": True, "stream_options": {"include_usage": True}})
    assert not ask_stream_usage(CHAT, {"stream": False})
    assert not ask_stream_usage("/generate", {"stream": True})
    assert not ask_stream_usage(CHAT, {"stream": True, "stream_options": "bad"})


# -- live ----------------------------------------------------------------------------------------
async def test_injected_usage_event_is_hidden_from_the_openai_client(start_app, start_router) -> None:
    sim_url = await start_app(build_app("tiny", time_scale=200.0))
    router, url = await start_router([sim_url])
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": tokenizer.synthetic_text(400, seed=3)}]
    try:
        stream = await client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                      max_tokens=4)
        chunks = [c async for c in stream]
        assert chunks and all(c.choices and c.usage is None for c in chunks)
        reported = _sample(router, "kvrouter_cached_tokens_reported_total", replica=sim_url)
        predicted = _sample(router, "kvrouter_cached_tokens_predicted_total", replica=sim_url)
        assert (reported, predicted) == (0.0, 0.0)  # a first turn: nothing cached, none predicted
        assert _sample(router, "kvrouter_cache_prediction_error_ratio_count") == 1
        # a client that asks gets its usage event, and the second turn's cache hit is reported
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, stream=True, max_tokens=4,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
        assert cached > 0
        assert _sample(router, "kvrouter_cached_tokens_reported_total", replica=sim_url) == cached
        assert _sample(router, "kvrouter_cached_tokens_predicted_total", replica=sim_url) > 0
        assert _sample(router, "kvrouter_usage_ignored_total", reason="missing") == 0
    finally:
        await client.close()


def _usage_upstream(usage: Any, raw_body: bytes | None = None) -> tuple[web.Application, list[dict[str, Any]], list[bytes]]:
    """A replica answering chat streams SGLang's way (usage event only if asked) and whole
    bodies with `usage` (or `raw_body` verbatim)."""
    seen: list[dict[str, Any]] = []
    sent: list[bytes] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        seen.append(body)
        if not body.get("stream"):
            payload = raw_body if raw_body is not None else orjson.dumps(
                {"id": "c", "object": "chat.completion", "choices": [], "usage": usage})
            return web.Response(body=payload, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events = [b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n',
                  b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}\n\n']
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(b'data: {"id":"c","choices":[],"usage":' + orjson.dumps(usage) + b"}\n\n")
        events.append(b"data: [DONE]\n\n")
        for e in events:
            sent.append(e)
            await resp.write(e)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post(CHAT, chat)
    return app, seen, sent


async def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + CHAT, data=orjson.dumps(body),
                          headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.read()


async def test_client_bytes_unchanged_but_for_the_injected_event(start_app, start_router) -> None:
    usage = {"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 0}}
    app, seen, sent = _usage_upstream(usage)
    up = await start_app(app)
    router, url = await start_router([up])
    status, got = await _post(url, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert status == 200 and seen[-1]["stream_options"] == {"include_usage": True}
    assert got == b"".join(e for e in sent if b'"choices":[]' not in e)
    assert _sample(router, "kvrouter_cached_tokens_reported_total", replica=up) == 0
    assert _sample(router, "kvrouter_cache_prediction_error_ratio_count") == 1
    # a client that asked: every byte as sent
    sent.clear()
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "stream_options": {"include_usage": True}}
    status, got = await _post(url, body)
    assert got == b"".join(sent) and b'"choices":[]' in got
    assert _sample(router, "kvrouter_cache_prediction_error_ratio_count") == 2


async def test_injection_can_be_turned_off(start_app, start_router) -> None:
    app, seen, sent = _usage_upstream({"prompt_tokens": 20})
    up = await start_app(app)
    router, url = await start_router([up], learning={"inject_stream_usage": False})
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    status, got = await _post(url, body)
    assert status == 200 and "stream_options" not in seen[-1] and got == b"".join(sent)
    assert _sample(router, "kvrouter_usage_ignored_total", reason="missing") == 1


async def test_garbage_usage_is_counted_and_relayed_untouched(start_app, start_router) -> None:
    cases = [({"prompt_tokens": -5}, "negative"), ({"prompt_tokens": "many"}, "garbage"),
             ("usage", "garbage"), (None, "missing"), ({"prompt_tokens": 9}, "no_cache_report")]
    for usage, reason in cases:
        app, _, sent = _usage_upstream(usage)
        up = await start_app(app)
        router, url = await start_router([up])
        status, got = await _post(url, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert status == 200 and orjson.loads(got)["usage"] == usage
        assert _sample(router, "kvrouter_usage_ignored_total", reason=reason) == 1, usage
        status, got = await _post(url, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                        "stream": True})
        assert status == 200 and got == b"".join(e for e in sent if b'"choices":[]' not in e)
        assert _sample(router, "kvrouter_usage_ignored_total", reason=reason) == 2, usage
    app, _, _ = _usage_upstream(None, raw_body=b'{"usage": {"prompt_tokens": 1')
    router, url = await start_router([await start_app(app)])
    status, got = await _post(url, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and got == b'{"usage": {"prompt_tokens": 1'
    assert _sample(router, "kvrouter_usage_ignored_total", reason="garbage") == 1


async def test_generate_usage_read_from_body_and_stream_end(start_app, start_router) -> None:
    sim_url = await start_app(build_app("tiny", time_scale=200.0))
    router, url = await start_router([sim_url])
    body = {"text": tokenizer.synthetic_text(400, seed=5), "sampling_params": {"max_new_tokens": 3}}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/generate", json=body) as r:
            first = (await r.json())["meta_info"]
        async with s.post(url + "/generate", json={**body, "stream": True}) as r:
            streamed = await r.read()
    assert first["cached_tokens"] == 0 and b'"meta_info"' in streamed
    last = [ln for ln in streamed.split(b"\n\n") if b"meta_info" in ln][-1]
    cached = orjson.loads(last[len(b"data: "):])["meta_info"]["cached_tokens"]
    assert cached > 0
    assert _sample(router, "kvrouter_cached_tokens_reported_total", replica=sim_url) == cached
    assert _sample(router, "kvrouter_cache_prediction_error_ratio_count") == 2


async def test_usage_event_split_across_reads_is_still_taken_out(start_app, start_router) -> None:
    usage_event = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":20,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
    content = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(content + usage_event[:30])
        await asyncio.sleep(0.01)  # a second read on the router's side, most likely
        await resp.write(usage_event[30:] + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post(CHAT, chat)
    up = await start_app(app)
    router, url = await start_router([up])
    status, got = await _post(url, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert status == 200 and got == content + b"data: [DONE]\n\n"
    assert _sample(router, "kvrouter_cached_tokens_reported_total", replica=up) == 4


async def test_a_fault_in_learning_never_fails_the_response(start_app, start_router, monkeypatch) -> None:
    app, _, sent = _usage_upstream({"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 0}})
    router, url = await start_router([await start_app(app)])

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("learner bug")

    monkeypatch.setattr(router.learner, "observe", broken)
    status, got = await _post(url, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and orjson.loads(got)["usage"]["prompt_tokens"] == 20
    status, got = await _post(url, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert status == 200 and got == b"".join(e for e in sent if b'"choices":[]' not in e)


def test_usage_request_is_added_to_the_clients_own_bytes() -> None:
    raw = b' \n{"model":"m","stream":true,"messages":[{"role":"user","content":"\\u00e9 x"}],"n":1.50}\n'
    body = orjson.loads(raw)
    spliced = body_asking_stream_usage(CHAT, body, raw)
    assert spliced is not None
    asked = bytes(spliced)
    assert asked.startswith(raw[:-2])  # the client's bytes, not re-serialized
    assert orjson.loads(asked) == {**orjson.loads(raw), "stream_options": {"include_usage": True}}
    assert body == orjson.loads(raw)  # the parsed body is left as it was (it may be shared)
    options = b'{"stream":true,"stream_options":{"continuous_usage_stats":false}}'
    asked = body_asking_stream_usage(CHAT, orjson.loads(options), options)
    assert asked is not None and orjson.loads(bytes(asked))["stream_options"] == \
        {"continuous_usage_stats": False, "include_usage": True}
    for done in (b'{"stream":true,"stream_options":{"include_usage":true}}', b'{"stream":false}'):
        assert body_asking_stream_usage(CHAT, orjson.loads(done), done) is None


@pytest.mark.parametrize("raw", [
    b'{"stream":true,"messages":[]}',
    b' {\n "stream" : true ,\n "stream_options" : null\n}\r\n',
    b'{"stream_options":{"include_usage":false,"x":[1,{"y":"}"}]},"stream":true,"m":"\\"}"}',
    b'{"stream_options":{},"stream":true,"stream_options":{"include_usage":false}}',
    b'{"z":"\\u00e9\xc3\xa9\xf0\x9f\x98\x80","stream":true,"a":{"b":[{}]},"stream_options":{"include_usage":0}}',
])
def test_asking_for_usage_by_splicing_equals_setting_it_on_the_parsed_body(raw: bytes) -> None:
    body = orjson.loads(raw)
    asked = body_asking_stream_usage(CHAT, body, raw)
    expected = orjson.loads(raw)
    assert ask_stream_usage(CHAT, expected)
    assert asked is not None and orjson.loads(bytes(asked)) == expected
    assert orjson.loads(orjson.dumps(orjson.loads(bytes(asked)))) == orjson.loads(orjson.dumps(expected))


@pytest.mark.parametrize("raw", [b'{"stream":true,"stream_options":false}',
                                 b'{"stream":true,"stream_options":{"include_usage":true}}'])
def test_usage_is_not_asked_where_the_client_asked_or_must_be_refused(raw: bytes) -> None:
    assert body_asking_stream_usage(CHAT, orjson.loads(raw), raw) is None


@pytest.mark.parametrize("raw", [b'{"stream":true,"stream_options":null}',
                                 b'{"stream":true,"stream_options":{"continuous_usage_stats":false}}'])
def test_a_client_stream_options_is_replaced_not_named_twice(raw: bytes) -> None:
    # A strict parser (serde, for one) refuses an object that names a key twice.
    asked = bytes(body_asking_stream_usage(CHAT, orjson.loads(raw), raw) or b"")
    assert asked.count(b'"stream_options"') == 1
    assert orjson.loads(asked)["stream_options"]["include_usage"] is True


async def test_usage_event_written_with_spaces_is_read_and_hidden(start_app, start_router) -> None:
    """A server writing JSON with Python's default separators (`"choices": []`): the router still
    reads its usage, and still takes out the usage event the client did not ask for."""
    sent: list[bytes] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events = [{"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({"id": "c", "choices": [], "usage": {
                "prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 8}}})
        for e in [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]:
            sent.append(e)
            await resp.write(e)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post(CHAT, chat)
    up = await start_app(app)
    router, url = await start_router([up])
    status, got = await _post(url, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert status == 200 and b'"choices": []' in b"".join(sent)
    assert got == b"".join(e for e in sent if b'"choices": []' not in e)
    assert _sample(router, "kvrouter_cached_tokens_reported_total", replica=up) == 8
    assert _sample(router, "kvrouter_usage_ignored_total", reason="missing") in (None, 0)


def test_a_rank_added_to_a_re_serialised_usage_request_is_still_one_json_object() -> None:
    # with dp_size > 1 the relay adds routed_dp_rank to the body the handler asked usage on
    from kvrouter.router.ranks import routed_body

    raw = b'{"stream":true,"stream_options":{"continuous_usage_stats":false},"messages":[]}'
    asked = body_asking_stream_usage(CHAT, orjson.loads(raw), raw)
    assert asked is not None
    ranked = bytes(routed_body(asked, 2))
    assert orjson.loads(ranked) == {**orjson.loads(raw), "routed_dp_rank": 2, "stream_options": {
        "continuous_usage_stats": False, "include_usage": True}}


def _count_problem(value: Any) -> str | None:
    """Why `value` is not a token count, or None if it is one."""
    if isinstance(value, bool) or not isinstance(value, int):
        return "garbage"
    if value < 0:
        return "negative"
    return "garbage" if value > 1 << 40 else None


def _checked_usage(usage: Any) -> UsageReport | str:
    """`from_usage` as its rules read, one check at a time: its one-pass common case must agree."""
    if usage is None:
        return "missing"
    if not isinstance(usage, dict):
        return "garbage"
    if "prompt_tokens" not in usage:
        return "missing"
    details = usage.get("prompt_tokens_details")
    if details is not None and not isinstance(details, dict):
        return "garbage"
    prompt = usage["prompt_tokens"]
    if (problem := _count_problem(prompt)) is not None:
        return problem
    completion = usage.get("completion_tokens")
    completion = completion if _count_problem(completion) is None else None  # left out, not held against it
    cached = details.get("cached_tokens") if details else None
    if cached is None:
        return UsageReport(prompt, None, completion)
    if (problem := _count_problem(cached)) is not None:
        return problem
    return "garbage" if cached > prompt else UsageReport(prompt, cached, completion)


def test_usage_common_case_agrees_with_every_check() -> None:
    class Count(int):
        pass

    absent = object()
    values = [absent, None, 0, 1, 5, 9, -1, True, 1.0, "3", 1 << 41, Count(4), []]
    for prompt in values:
        for completion in values:
            for details in (absent, None, "x", {}, 3):
                for cached in values:
                    usage: dict[str, Any] = {}
                    if prompt is not absent:
                        usage["prompt_tokens"] = prompt
                    if completion is not absent:
                        usage["completion_tokens"] = completion
                    if details is not absent:
                        usage["prompt_tokens_details"] = dict(details) if isinstance(details, dict) else details
                        if isinstance(details, dict) and cached is not absent:
                            usage["prompt_tokens_details"]["cached_tokens"] = cached
                    got, want = from_usage(usage), _checked_usage(usage)
                    assert got == want and type(got) is type(want), (usage, got, want)
