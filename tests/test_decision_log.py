"""The decision log (router/decision_log.py): one JSON line per request, written by a background
thread, rotated by size, never failing a request; and the shadow policies whose decisions it
records."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import openai
import orjson
import pytest

from kvrouter.loadtest import tokenizer
from kvrouter.loadtest.sim_server import build_app
from kvrouter.router.decision_log import LOG_FORMAT, DecisionLog, prefix_marks, short_hash


def read_log(path: Path) -> list[dict[str, Any]]:
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    assert lines[0] == {"format": LOG_FORMAT}
    return lines[1:]


async def wait_for_lines(path: Path, n: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The log's lines once it has `n` of them (the writer thread is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists() and path.stat().st_size:
            lines = read_log(path)
            if len(lines) >= n:
                return lines
        assert time.monotonic() < deadline, f"decision log has fewer than {n} lines"
        await asyncio.sleep(0.02)


def _sample(router: Any, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


def test_prefix_marks_at_powers_of_two_and_the_last_block() -> None:
    blocks = tuple(range(100, 110))  # 10 blocks: marks at 0, 1, 3, 7 and the last (9)
    assert prefix_marks(blocks) == [short_hash(b) for b in (100, 101, 103, 107, 109)]
    assert prefix_marks(blocks[:8]) == [short_hash(b) for b in (100, 101, 103, 107)]  # 7 is last
    assert prefix_marks(()) == []


def test_lines_rotate_by_size_and_every_file_names_its_format(tmp_path: Path) -> None:
    log = DecisionLog(tmp_path / "d.jsonl", max_bytes=4096, backups=2)
    for i in range(200):
        log.write({"i": i, "pad": "x" * 40})
    log.close()
    files = sorted(tmp_path.glob("d.jsonl*"))
    assert [f.name for f in files] == ["d.jsonl", "d.jsonl.1", "d.jsonl.2"]
    kept = [line["i"] for f in reversed(files) for line in read_log(f)]
    assert kept == list(range(200 - len(kept), 200))  # the newest lines, in order, none torn


def test_a_line_that_cannot_be_written_is_dropped_and_counted(tmp_path: Path) -> None:
    drops: list[int] = []
    log = DecisionLog(tmp_path / "d.jsonl", on_drop=lambda: drops.append(1))
    log.write({"bad": object()})  # not JSON: dropped, no exception
    log.write({"ok": 1})
    log.close()
    assert read_log(tmp_path / "d.jsonl") == [{"ok": 1}] and drops == [1] and log.dropped == 1


async def test_one_line_per_request_with_prediction_outcome_and_shadows(
    start_app, start_router, tmp_path: Path
) -> None:
    sims = [await start_app(build_app("tiny", time_scale=200.0, seed=i)) for i in range(2)]
    path = tmp_path / "decisions.jsonl"
    router, url = await start_router(
        sims, observability={"decision_log": str(path)},
        routing={"shadow": ["prefix-aware", "consistent-hash"]})
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": tokenizer.synthetic_text(600, seed=5)}]
    try:
        await client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                             extra_headers={"x-session-id": "s-1"})
        stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                                      stream=True, extra_headers={"x-session-id": "s-1"})
        [c async for c in stream]
    finally:
        await client.close()
    first, second = await wait_for_lines(path, 2)
    assert first["session"] == second["session"] == short_hash("s-1")
    assert "s-1" not in path.read_text()  # the session key itself is never logged
    for line in (first, second):
        assert line["status"] == 200 and line["replica"] in sims and line["attempts"] == 1
        assert line["policy"] == "coding_agent" and line["reason"]
        assert line["prompt_tokens"] > 0 and line["blocks"] > 0 and line["prefix"]
        assert line["ttft_s"] is not None and line["duration_s"] >= line["ttft_s"]
        assert 0 < line["routed_s"] < 5  # the router's own time before it sent the request
        assert line["predicted_ttft_s"] > 0 and line["output_tokens"] == 3
        assert set(line["shadow"]) == {"prefix-aware", "consistent-hash"}
        for guess in line["shadow"].values():
            assert guess["replica"] in sims and guess["predicted_ttft_s"] > 0
    assert second["t"] >= first["t"] and first["prefix"] == second["prefix"]
    assert first["predicted_cached"] == 0 and first["reported_cached"] == 0
    assert second["replica"] == first["replica"]  # the session stays home, where its prefix is
    assert second["predicted_cached"] > 0 and second["reported_cached"] > 0
    for shadow in ("prefix-aware", "consistent-hash"):
        total = sum(_sample(router, "kvrouter_shadow_decisions_total", shadow=shadow, agrees=a)
                    for a in ("true", "false"))
        assert total == 2
        assert _sample(router, "kvrouter_shadow_predicted_ttft_seconds_total",
                       policy=shadow, role="shadow") > 0
    assert _sample(router, "kvrouter_shadow_predicted_ttft_seconds_total",
                   policy="coding_agent", role="live") > 0


async def test_a_request_no_replica_took_is_logged_too(start_router, closed_port_url, tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    _, url = await start_router([closed_port_url], observability={"decision_log": str(path)},
                                upstream={"max_attempts": 1})
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "hello"}) as r:
            assert r.status == 503
    (line,) = await wait_for_lines(path, 1)
    assert line["status"] == 503 and line["replica"] == closed_port_url and line["ttft_s"] is None


def test_a_log_path_that_cannot_be_written_stops_start_up(tmp_path: Path) -> None:
    from kvrouter.router.app import Router
    from kvrouter.router.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"observability.decision_log: cannot write .* \(Is a directory\)"):
        Router(parse_config({"replicas": ["http://127.0.0.1:1"], "observability": {"decision_log": str(tmp_path)}}))


async def test_a_disk_that_fails_later_never_fails_a_request(start_app, start_router, tmp_path: Path) -> None:
    sim = await start_app(build_app("tiny", time_scale=200.0))
    router, url = await start_router([sim], observability={"decision_log": str(tmp_path / "d.jsonl")})
    assert router.decision_log is not None
    handler = router.decision_log._handler
    with open(os.devnull) as read_only:  # every write now fails inside the writer thread
        handler.stream = read_only
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(url + "/v1/completions",
                                  json={"model": "tiny", "prompt": "hello", "max_tokens": 2}) as r:
                    assert r.status == 200
        await asyncio.to_thread(router.decision_log._queue.join)  # the thread took them all
        handler.stream = None  # reopened by the next write


def test_writes_never_wait_for_a_stuck_disk(tmp_path: Path) -> None:
    """The writer thread is stuck in a write: lines past the queue's size are dropped at once,
    counted, and the ones queued are written once the disk is back."""
    import threading

    log = DecisionLog(tmp_path / "d.jsonl", queue_size=2)
    stuck, entered = threading.Event(), threading.Event()
    emit = log._handler.emit

    def slow_emit(record):  # the disk hangs on the first line
        entered.set()
        stuck.wait(10)
        emit(record)

    log._handler.emit = slow_emit
    log.write({"i": 0})
    assert entered.wait(10)  # the thread holds line 0; the queue has room for 2 more
    started = time.monotonic()
    for i in range(1, 11):
        log.write({"i": i})
    assert time.monotonic() - started < 1.0  # nothing waited for the disk
    assert log.dropped == 8
    stuck.set()
    log.close()
    assert [line["i"] for line in read_log(tmp_path / "d.jsonl")] == [0, 1, 2]


def test_each_worker_process_gets_its_own_file() -> None:
    from kvrouter.router.decision_log import worker_path

    assert worker_path("logs/decisions.jsonl", None) == Path("logs/decisions.jsonl")
    assert worker_path("logs/decisions.jsonl", 3) == Path("logs/decisions.w3.jsonl")


async def test_a_client_that_leaves_mid_stream_still_gets_its_line(start_app, start_router, tmp_path: Path) -> None:
    release = asyncio.Event()

    async def chat(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        await request.read()
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n')
        await release.wait()  # then nothing more until the test ends
        return resp

    app = aiohttp.web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    up = await start_app(app)
    path = tmp_path / "decisions.jsonl"
    _, url = await start_router([up], observability={"decision_log": str(path)})
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions",
                              json={"model": "m", "messages": [], "stream": True}) as r:
                assert r.status == 200
                await r.content.readuntil(b"\n\n")  # the first event, then the client goes away
        (line,) = await wait_for_lines(path, 1)
        assert line["status"] == 499 and line["replica"] == up and line["ttft_s"] is not None
    finally:
        release.set()


async def test_sampled_shadows_appear_on_some_lines_only(start_app, start_router, tmp_path: Path) -> None:
    sims = [await start_app(build_app("tiny", time_scale=200.0, seed=i)) for i in range(2)]
    path = tmp_path / "decisions.jsonl"
    router, url = await start_router(
        sims, observability={"decision_log": str(path)},
        routing={"shadow": ["consistent-hash"], "shadow_sample": 0.5})
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        for i in range(12):
            await client.completions.create(model="tiny", prompt=f"request {i}", max_tokens=2)
    finally:
        await client.close()
    lines = await wait_for_lines(path, 12)
    with_shadow = [line for line in lines if "shadow" in line]
    assert 0 < len(with_shadow) < 12  # every line has its own prediction; the shadow only some
    assert all(line["predicted_ttft_s"] > 0 for line in lines)
    total = sum(_sample(router, "kvrouter_shadow_decisions_total", shadow="consistent-hash", agrees=a)
                for a in ("true", "false"))
    assert total == len(with_shadow)
