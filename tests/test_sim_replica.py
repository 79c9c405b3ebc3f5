"""`kvrouter sim-replica`: a real aiohttp server imitating one SGLang replica, driven by the model.

Real servers on 127.0.0.1, the real openai client, prometheus_client's parser and a pyzmq SUB.
The `tiny` profile and a large time scale keep every test well under a second of model work.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.cli import build_parser
from kvrouter.loadtest import tokenizer
from kvrouter.loadtest.profiles import load_profile
from kvrouter.loadtest.radix_cache import DEVICE, page_keys
from kvrouter.loadtest.sim_prompt import render_chat
from kvrouter.loadtest.sim_replica import SimReplica
from kvrouter.loadtest.sim_server import SIM_KEY, build_app
from kvrouter.sglang_protocol import block_hash as bh
from kvrouter.sglang_protocol import kv_events as kve
from kvrouter.sglang_protocol import metric_names as sg
from kvrouter.sglang_protocol.loads import parse_loads_json
from kvrouter.sglang_protocol.signals import parse_metrics_text

FAST = 200.0  # model seconds per wall second
PS = 16  # tiny profile page size

Start = Callable[..., Awaitable[tuple[SimReplica, str]]]


@pytest.fixture
async def start_sim(start_app) -> Start:
    async def _start(**kwargs: Any) -> tuple[SimReplica, str]:
        kwargs.setdefault("time_scale", FAST)
        profile = kwargs.pop("profile", "tiny")
        app = build_app(profile, **kwargs)
        url = await start_app(app)
        return app[SIM_KEY], url

    return _start


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def _until(cond: Callable[[], bool], what: str) -> None:
    # Bounded by the pytest timeout; no wall-clock assertion.
    while not cond():
        await asyncio.sleep(0.005)


def _long_text(n_tokens: int, seed: int) -> str:
    return tokenizer.synthetic_text(n_tokens, seed)


# ----------------------------------------------------------------------------------------------
# cache reuse across turns
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_turn2_hits_turn1_prompt_and_reply_on_same_replica_only(start_sim, stream):
    sim_a, url_a = await start_sim(seed=1)
    sim_b, url_b = await start_sim(seed=2)
    a, b = _client(url_a), _client(url_b)
    turn1 = [
        {"role": "system", "content": "You are a coding agent. " + _long_text(100, 7)},
        {"role": "user", "content": "Fix the bug in:\n" + _long_text(300, 8)},
    ]

    async def ask(client: openai.AsyncOpenAI, messages: list[dict]) -> tuple[str, Any]:
        if not stream:
            r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=60)
            return r.choices[0].message.content, r.usage
        s = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=60, stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = [], None
        async for c in s:
            if c.choices:
                text.append(c.choices[0].delta.content or "")
            if c.usage is not None:
                usage = c.usage
        return "".join(text), usage

    try:
        reply, u1 = await ask(a, turn1)
        assert u1.prompt_tokens == tokenizer.count_tokens(render_chat(turn1))
        assert u1.completion_tokens == len(reply) // 4 and 1 <= u1.completion_tokens <= 60
        assert u1.prompt_tokens_details.cached_tokens == 0
        turn2 = turn1 + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Now add a test."},
        ]
        _, u2 = await ask(a, turn2)
        t1 = u1.prompt_tokens + u1.completion_tokens
        # Finish inserts the full pages of prompt + output - 1 tokens; turn 2 matches them all.
        assert u2.prompt_tokens_details.cached_tokens == (t1 - 1) // PS * PS
        assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens - PS
        # Another replica has never seen this conversation.
        _, u2b = await ask(b, turn2)
        assert u2b.prompt_tokens == u2.prompt_tokens
        assert u2b.prompt_tokens_details.cached_tokens == 0
    finally:
        await a.close()
        await b.close()


async def test_generate_native_shapes_and_namespaces(start_sim):
    sim, url = await start_sim()
    prompt = _long_text(200, 3)
    async with aiohttp.ClientSession() as s:
        async def gen(body: dict) -> dict:
            async with s.post(url + "/generate", json=body) as r:
                assert r.status == 200
                return await r.json()

        body = {"text": prompt, "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}, "rid": "r-1"}
        out = await gen(body)
        meta = out["meta_info"]
        assert meta["id"] == "r-1"
        assert meta["finish_reason"] == {"type": "length", "length": 20}
        assert meta["prompt_tokens"] == 200 and meta["completion_tokens"] == 20
        assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
        assert len(out["output_ids"]) == 20 and len(out["text"]) == 80
        # Same prompt again: all full pages but the last prompt token's page are cached.
        again = await gen({**body, "rid": "r-2"})
        assert again["meta_info"]["cached_tokens"] == (200 - 1) // PS * PS
        # A different extra_key / cache_salt is a different namespace: no sharing.
        salted = await gen({**body, "rid": "r-3", "extra_key": "tenant-b"})
        assert salted["meta_info"]["cached_tokens"] == 0
        # input_ids continue the text cache: prompt ids + output ids of r-1 hit its pages.
        ids = tokenizer.encode(prompt + out["text"]) + [5, 6, 7]
        cont = await gen({"input_ids": ids, "sampling_params": {"max_new_tokens": 4}, "rid": "r-4"})
        assert cont["meta_info"]["cached_tokens"] == (220 - 1) // PS * PS

        # Streaming: cumulative text, finish_reason only on the last event, then [DONE].
        events = []
        async with s.post(url + "/generate", json={**body, "rid": "r-5", "stream": True}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
        assert events[-1] == b"[DONE]"
        objs = [orjson.loads(e) for e in events[:-1]]
        texts = [o["text"] for o in objs]
        assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
        assert objs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
        assert all(o["meta_info"]["finish_reason"] is None for o in objs[:-1])
        assert len(objs[-1]["text"]) == 80

        # Errors: SGLang's native shape.
        async with s.post(url + "/generate", data=b"{not json") as r:
            assert r.status == 400
            assert "message" in (await r.json())["error"]
        async with s.post(url + "/generate", json={"sampling_params": {}}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["message"].startswith("Either text, input_ids")
        async with s.post(url + "/v1/chat/completions", json={"model": "tiny"}) as r:
            assert r.status == 400
            err = await r.json()
            assert err["object"] == "error" and err["code"] == 400


# ----------------------------------------------------------------------------------------------
# OpenAI client
# ----------------------------------------------------------------------------------------------


async def test_openai_client_streaming_non_streaming_and_usage_chunk(start_sim):
    _, url = await start_sim()
    client = _client(url)
    msgs = [{"role": "user", "content": "write a function"}]
    try:
        r = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, extra_body={"ignore_eos": True})
        assert r.object == "chat.completion"
        assert r.choices[0].finish_reason == "length"
        assert len(r.choices[0].message.content) == 4 * 30
        assert r.usage.completion_tokens == 30

        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=30, stream=True, extra_body={"ignore_eos": True})]
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "length"
        assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
        assert len("".join(c.choices[0].delta.content or "" for c in chunks)) == 120

        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=30, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt as before
        assert chunks[-2].choices[0].finish_reason == "length"

        c = await client.completions.create(model="tiny", prompt="def f(x):", max_tokens=8)
        assert c.object == "text_completion" and c.usage.completion_tokens == len(c.choices[0].text) // 4
        pieces = [x async for x in await client.completions.create(
            model="tiny", prompt="def f(x):", max_tokens=8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]
        assert "".join(p.choices[0].text for p in pieces if p.choices) and pieces[-1].usage.completion_tokens == 8

        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
    finally:
        await client.close()


async def test_cache_report_off_gives_null_details(start_sim):
    _, url = await start_sim(enable_cache_report=False)
    async with aiohttp.ClientSession() as s:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            assert (await r.json())["usage"]["prompt_tokens_details"] is None


# ----------------------------------------------------------------------------------------------
# metrics and load endpoints
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hicache", [False, True])
async def test_metrics_and_loads_parse(start_sim, hicache):
    # The gauges are read once the replica is idle: a short idle refresh (SGLang: 30 s) lets them
    # show the drained state at the scrape.
    profile = load_profile("tiny").model_copy(update={"idle_metrics_interval_s": 1e-3})
    if hicache:
        profile = profile.model_copy(update={"host_total_num_tokens": 40960})
    sim, url = await start_sim(profile=profile, served_model_name="kimi")
    client = _client(url)
    try:
        for _ in range(2):  # the second one hits the cache
            await client.chat.completions.create(
                model="kimi", messages=[{"role": "user", "content": _long_text(100, 1)}], max_tokens=10)
    finally:
        await client.close()
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        expected = {spec for spec in sg.METRIC_SPECS}
        if not hicache:
            expected = {
                spec for spec in expected
                if spec.base not in (sg.HICACHE_HOST_USED_TOKENS, sg.HICACHE_HOST_TOTAL_TOKENS,
                                     sg.EVICTED_TOKENS_TOTAL, sg.LOAD_BACK_TOKENS_TOTAL)
            }
        for spec in expected:
            fam_name = spec.name()[: -len("_total")] if spec.type == "counter" else spec.name()
            assert fam_name in families, spec.name()
            fam = families[fam_name]
            assert fam.type == spec.type and fam.documentation == spec.help
            # A labelled counter shows no series before its first increment (prometheus_client).
            if spec.base not in (sg.NUM_ABORTED_REQUESTS_TOTAL, sg.EVICTED_TOKENS_TOTAL,
                                 sg.LOAD_BACK_TOKENS_TOTAL, sg.NUM_RETRACTED_REQUESTS_TOTAL,
                                 sg.NUM_RETRACTED_INPUT_TOKENS_TOTAL,
                                 sg.NUM_RETRACTED_OUTPUT_TOKENS_TOTAL):
                assert fam.samples, spec.name()
            for sample in fam.samples:
                assert set(spec.labels) <= set(sample.labels), (spec.name(), sample.labels)
                if sg.CACHE_TYPE in spec.labels:
                    continue
                assert sample.labels["model_name"] == "kimi"
                assert sample.labels["engine_type"] == "unified"
                if "tp_rank" in spec.labels:
                    assert (sample.labels["tp_rank"], sample.labels["pp_rank"], sample.labels["moe_ep_rank"]) == ("0", "0", "0")
        requests = {s.name: s.value for s in families["sglang:num_requests"].samples}
        assert requests["sglang:num_requests_total"] == 2
        ttft_count = [s.value for s in families["sglang:time_to_first_token_seconds"].samples
                      if s.name.endswith("_count")]
        assert ttft_count == [2]
        cached = {s.labels["cache_source"]: s.value for s in families["sglang:cached_tokens"].samples}
        assert cached["device"] > 0

        signals = parse_metrics_text(text, strict=True)
        assert signals.max_total_num_tokens == 20480
        assert signals.num_running_reqs == 0 and signals.num_queue_reqs == 0
        assert signals.kv_evictable_tokens > 0
        if hicache:
            assert signals.host_total_tokens == 40960

        async with s.get(url + "/v1/loads") as r:
            loads = await r.json()
        assert loads["loads"][0]["max_total_num_tokens"] == 20480
        assert parse_loads_json(loads).max_total_num_tokens == 20480
        async with s.get(url + "/v1/loads?include=all") as r:
            full = await r.json()
        assert full["loads"][0]["memory"]["token_capacity"] == 20480
        async with s.get(url + "/v1/loads?include=bogus") as r:
            assert r.status == 400 and "detail" in await r.json()
        async with s.get(url + "/v1/loads?format=prometheus&include=all") as r:
            prom = await r.text()
        assert parse_metrics_text(prom, strict=True).max_total_num_tokens == 20480
        async with s.get(url + "/get_load") as r:
            legacy = await r.json()
        assert isinstance(legacy, list) and parse_loads_json(legacy).num_running_reqs == 0
        async with s.get(url + "/server_info") as r:
            info = await r.json()
        assert info["max_total_num_tokens"] == 20480 and info["page_size"] == PS
        assert info["max_running_requests"] == 8
        for path in ("/health", "/health_generate", "/model_info", "/get_server_info"):
            async with s.get(url + path) as r:
                assert r.status == 200, path
        async with s.get(url + "/v1/models/nope") as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"


# ----------------------------------------------------------------------------------------------
# aborts
# ----------------------------------------------------------------------------------------------

LONG = {"ignore_eos": True}


async def test_client_disconnect_mid_stream_aborts_in_model(start_sim):
    sim, url = await start_sim(time_scale=5.0)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000,
            "stream": True, **LONG}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url + "/v1/chat/completions", json=body)
        seen = 0
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"content"' in line:
                seen += 1
                if seen >= 2:  # role chunk + some text: the request is decoding
                    break
        assert sim.model.load(sim.now()).num_running_reqs == 1
        resp.close()  # the client goes away mid-stream
    await _until(lambda: sim.model.num_aborted_requests_total == 1, "abort")
    sim.poll()
    load = sim.model.load(sim.now())
    assert load.num_running_reqs == 0 and load.num_queue_reqs == 0
    assert load.num_used_tokens == 0  # slot freed, pages unlocked (evictable, not used)
    assert sim.model.num_requests_total == 0
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            signals = parse_metrics_text(await r.text())
            assert signals.num_running_reqs == 0


async def test_flush_cache_refused_while_running_and_abort_request(start_sim):
    sim, url = await start_sim(time_scale=5.0)
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
            "rid": "long-1", "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url + "/generate", json=body)
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        async with s.post(url + "/flush_cache") as r:
            assert r.status == 400
        async with s.post(url + "/abort_request", json={"rid": "long-1"}) as r:
            assert r.status == 200
        events = [first] + [line async for line in resp.content]
        payloads = [e[6:].strip() for e in events if e.startswith(b"data: ")]
        assert payloads[-1] == b"[DONE]"
        final = orjson.loads(payloads[-2])
        assert final["meta_info"]["finish_reason"]["type"] == "abort"
        resp.close()
        assert sim.model.num_aborted_requests_total == 1
        async with s.post(url + "/flush_cache") as r:
            assert r.status == 200
            assert (await r.text()).startswith("Cache flushed.")
        async with s.get(url + "/flush_cache") as r:
            assert r.status == 200
    assert sim.model.cache.dev_pages == 0


# ----------------------------------------------------------------------------------------------
# KV events
# ----------------------------------------------------------------------------------------------


def _apply(state: dict[str, set[int]], batch: kve.KVEventBatch) -> None:
    for ev in batch.events:
        if isinstance(ev, kve.BlockStored):
            state.setdefault(ev.medium, set()).update(ev.block_hashes)
        elif isinstance(ev, kve.BlockRemoved):
            missing = set(ev.block_hashes) - state.get(ev.medium, set())
            assert not missing, "BlockRemoved of a block never stored"
            state[ev.medium] -= set(ev.block_hashes)
        elif isinstance(ev, kve.AllBlocksCleared):
            state.clear()


async def _replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the ROUTER replay socket for every buffered batch with seq >= start (DEALER side)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    out = []
    try:
        await dealer.send_multipart([b"", kve.replay_request(start)])
        while True:
            empty, seq_frame, payload = await dealer.recv_multipart()
            assert empty == b""
            seq = kve.unpack_seq(seq_frame)
            if seq == -1:
                return out
            out.append((seq, payload))
    finally:
        dealer.close(linger=0)


@pytest.mark.parametrize("hicache", [False, True])
async def test_kv_event_stream_reproduces_cache_contents(start_sim, hicache):
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    profile = load_profile("tiny")
    if hicache:  # host pool twice the device pool (--hicache-ratio 2): write_through mirrors it
        profile = profile.model_copy(update={"host_total_num_tokens": 2 * profile.max_total_num_tokens})
    cfg = {"publisher": "zmq", "topic": "kv-events", "endpoint": f"tcp://127.0.0.1:{port}",
           "replay_endpoint": "tcp://127.0.0.1:*"}
    sim, url = await start_sim(profile=profile, kv_events_config=orjson.dumps(cfg).decode())
    live: dict[int, bytes] = {}

    async def receive() -> None:  # a live consumer, polling all along like a router would
        while True:
            topic, seq_frame, payload = await sub.recv_multipart()
            assert topic == b"kv-events"
            live[kve.unpack_seq(seq_frame)] = payload

    receiver = asyncio.create_task(receive())
    try:
        assert sim.publisher is not None and sim.publisher.replay_endpoint
        await asyncio.sleep(0.05)  # let the PUB connect (anything missed is replayed below)
        seqs_text: list[tuple[list[int], list[int]]] = []
        async with aiohttp.ClientSession() as s:
            # 5 x ~6k-token prompts in a 20k-token pool: later ones evict earlier ones.
            for i in range(5):
                prompt = _long_text(6000 + 37 * i, 100 + i)
                body = {"text": prompt, "sampling_params": {"max_new_tokens": 9, "ignore_eos": True}}
                async with s.post(url + "/generate", json=body) as r:
                    out = await r.json()
                tokens = tokenizer.encode(prompt + out["text"])
                seqs_text.append((page_keys(tokens, PS, sim.served_model_name), tokens))
            # One hit on a survivor so that (with HiCache) host pages come back too.
            prompt = _long_text(6000, 100)
            body = {"text": prompt + "more", "sampling_params": {"max_new_tokens": 3}}
            async with s.post(url + "/generate", json=body) as r:
                out = await r.json()
            tokens = tokenizer.encode(prompt + "more" + out["text"])
            seqs_text.append((page_keys(tokens, PS, sim.served_model_name), tokens))
        sim.poll()
        assert sim.model.evicted_tokens_total > 0
        last_seq = sim.publisher.seq - 1

        await _until(lambda: last_seq in live, "live stream caught up")
        replayed = await _replay(ctx, sim.publisher.replay_endpoint, 0)
        assert [q for q, _ in replayed] == list(range(last_seq + 1))
        for q, payload in replayed:  # live messages are the same bytes as the replay buffer
            if q in live:
                assert live[q] == payload
        assert live, "nothing arrived on the SUB socket"

        state: dict[str, set[int]] = {}
        removed_any = False
        for _, payload in replayed:
            batch = kve.decode_batch(payload)
            assert batch.attn_dp_rank == 0
            for ev in batch.events:
                if isinstance(ev, kve.BlockStored):
                    assert ev.block_size == PS and len(ev.token_ids) == PS * len(ev.block_hashes)
                    assert ev.medium in (kve.MEDIUM_GPU, kve.MEDIUM_CPU)
                removed_any |= isinstance(ev, kve.BlockRemoved)
            _apply(state, batch)
        assert removed_any

        # Expected: the model's pages per tier, hashed independently with SGLang's block hash.
        expect_gpu: set[int] = set()
        expect_cpu: set[int] = set()
        for keys, tokens in seqs_text:
            hashes = bh.token_block_hashes(tokens, PS, include_partial=False)
            for key, h in zip(keys, hashes):
                tier = sim.model.cache.tier_of(key)
                if tier == DEVICE:
                    expect_gpu.add(h)
                elif tier is not None:
                    expect_cpu.add(h)
        assert len(expect_gpu) == sim.model.cache.dev_pages
        assert state.get(kve.MEDIUM_GPU, set()) == expect_gpu
        assert state.get(kve.MEDIUM_CPU, set()) == expect_cpu
        if hicache:
            assert expect_cpu
        # A parent-linked chain: the first stored block of the first request starts at the root.
        first = kve.decode_batch(replayed[0][1]).events[0]
        assert isinstance(first, kve.BlockStored) and first.parent_block_hash is None
        assert first.block_hashes[0] == bh.token_block_hashes(seqs_text[0][1][:PS], PS)[0]

        # flush_cache -> AllBlocksCleared
        assert sim.model.flush_cache()
        sim.poll()
        seq, payload = (await _replay(ctx, sim.publisher.replay_endpoint, last_seq + 1))[-1]
        assert isinstance(kve.decode_batch(payload).events[-1], kve.AllBlocksCleared)
    finally:
        receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await receiver
        sub.close(linger=0)
        ctx.term()


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def test_cli_sim_replica_flags():
    args = build_parser().parse_args(["sim-replica", "--port", "30000"])
    assert args.enable_cache_report and args.enable_metrics
    assert args.profile == "tiny" and args.time_scale == 1.0 and args.host == "127.0.0.1"
    args = build_parser().parse_args([
        "sim-replica", "--port", "1", "--disable-cache-report", "--profile", "kimi-k2.6-b200-tp4",
        "--time-scale", "50", "--seed", "3", "--max-running-requests", "4", "--page-size", "32",
        "--served-model-name", "kimi", "--kv-events-config", '{"publisher":"zmq"}',
    ])
    assert not args.enable_cache_report and args.max_running_requests == 4 and args.page_size == 32
    sim = SimReplica("tiny", max_running_requests=4, page_size=32, served_model_name="kimi")
    assert sim.profile.max_running_requests == 4 and sim.profile.page_size == 32


def test_the_scheduler_estimate_comes_from_the_clients_max_new_tokens():
    """The model admits on max_new_tokens, never on the output it was told to produce: the
    client's value when given, else what the context leaves (SGLang's default)."""
    sim = SimReplica("tiny", context_length=8192, clock=lambda: 0.0)
    prompt = list(range(1, 101))
    given = sim.submit(input_ids=prompt, max_new_tokens=50)
    missing = sim.submit(input_ids=prompt, max_new_tokens=None)
    assert sim.model._reqs[given.rid].max_new == 50
    assert sim.model._reqs[missing.rid].max_new == 8192 - len(prompt)


@pytest.mark.parametrize("ratio", [1.5, 8.0])
async def test_chars_per_token_scales_prompt_and_output_tokens(start_sim, ratio):
    _, url = await start_sim(chars_per_token=ratio)
    client = _client(url)
    prompt = "x" * 1200
    try:
        r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=20, extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == round(1200 / ratio)
        assert r.usage.completion_tokens == 20 and len(r.choices[0].text) == int(20 * ratio)
    finally:
        await client.close()
    args = build_parser().parse_args(["sim-replica", "--port", "1", "--chars-per-token", str(ratio)])
    assert args.chars_per_token == ratio
    assert build_parser().parse_args(["sim-replica", "--port", "1"]).chars_per_token == 4.0
