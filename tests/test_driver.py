from __future__ import annotations

import asyncio
import io
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from kvrouter.loadtest.driver import run_load
from kvrouter.loadtest.progress import StderrProgress
from kvrouter.loadtest.report import (
    RESULT_KEYS,
    RequestRecord,
    load_imbalance,
    percentile,
    summarize_requests,
)
from kvrouter.loadtest.workload_config import load_workload


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(delta: dict[str, Any]) -> bytes:
    return _sse({"id": "c", "object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


@dataclass
class FakeOpenAI:
    """A streaming OpenAI-shaped server with SGLang's usage chunk and a /metrics page."""

    replica: str = "r0"
    running: int = 1
    tokens: int = 4  # content chunks per reply, one token each
    first_token_delay_s: float = 0.0
    fail_every: int = 0  # every Nth request: HTTP 500
    sse_error_every: int = 0  # every Nth request: an error event mid-stream
    hang_every: int = 0  # every Nth request: never finishes
    received: list[dict[str, Any]] = field(default_factory=list)
    ok_prompt_tokens: int = 0
    ok_cached_tokens: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        text = (
            "# HELP sglang:num_running_reqs The number of running requests.\n"
            "# TYPE sglang:num_running_reqs gauge\n"
            f'sglang:num_running_reqs{{model_name="m"}} {self.running}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(self.received) + 1
        self.received.append({"headers": {k.lower(): v for k, v in request.headers.items()}, "body": body})
        if self.fail_every and n % self.fail_every == 0:
            return web.Response(status=500, text="internal error")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream",
                                           "x-kvrouter-replica": self.replica})
        await resp.prepare(request)
        if self.hang_every and n % self.hang_every == 0:
            await asyncio.Event().wait()
        await asyncio.sleep(self.first_token_delay_s)
        await resp.write(_chunk({"role": "assistant", "content": ""}))
        for i in range(self.tokens):
            await resp.write(_chunk({"content": f"w{i}x"}))
            if self.sse_error_every and n % self.sse_error_every == 0:
                await resp.write(_sse({"error": {"message": "upstream died", "type": "server_error"}}))
                await resp.write(b"data: [DONE]\n\n")
                return resp
            await asyncio.sleep(0.001)
        prompt = sum(len(m["content"]) for m in body["messages"]) // 4
        cached = prompt // 3
        self.ok_prompt_tokens += prompt
        self.ok_cached_tokens += cached
        await resp.write(_sse({"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [],
                               "usage": {"prompt_tokens": prompt, "completion_tokens": self.tokens,
                                         "total_tokens": prompt + self.tokens,
                                         "prompt_tokens_details": {"cached_tokens": cached}}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def _serve(fake: FakeOpenAI) -> str:
        runner = web.AppRunner(fake.app(), shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield _serve
    for runner in runners:
        await runner.cleanup()


async def test_run_load_reports_the_contract(serve: Any) -> None:
    a, b = FakeOpenAI(replica="r0", running=1), FakeOpenAI(replica="r1", running=3)
    url_a, url_b = await serve(a), await serve(b)
    lines: list[str] = []
    records: list[RequestRecord] = []
    report = await run_load(url_a, load_workload("tiny"), users=4, duration_s=1.5, seed=1,
                            replica_metrics_urls=[url_a, url_b + "/metrics"], progress=lines.append,
                            metrics_interval_s=0.1, contender="kvrouter", records_out=records)

    assert report["schema"] == 1 and set(report) == {"schema", "workload", "results"}
    assert report["workload"]["name"] == "tiny" and report["workload"]["seed"] == 1
    assert report["workload"]["users"] == 4 and report["workload"]["duration_s"] == 1.5
    orjson.dumps(report)  # JSON-serialisable
    res = report["results"]["kvrouter"]
    assert list(res) == list(RESULT_KEYS)
    assert res["requests_ok"] > 10 and res["requests_failed"] == 0
    assert res["requests_ok"] == len(a.received) == len(records)  # nothing dropped
    for key in ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "itl_p50_s", "output_tps_per_user",
                "tokens_per_min_per_replica", "e2e_p95_s"):
        assert res[key] is not None and res[key] > 0, key
    assert res["ttft_p50_s"] <= res["ttft_p95_s"] <= res["ttft_p99_s"]
    # Each request's first token comes before its end, so the same percentile orders the same way
    # (p99 TTFT against p95 end-to-end would not: one slow first token on a loaded machine).
    assert res["ttft_p95_s"] <= res["e2e_p95_s"] * 1.01 + 0.05
    assert res["cache_hit_rate"] == pytest.approx(a.ok_cached_tokens / a.ok_prompt_tokens)
    # running requests 1 and 3 in every sample: max/mean 1.5, population CV 1/2.
    assert res["load_max_over_mean"] == pytest.approx(1.5)
    assert res["load_cv"] == pytest.approx(0.5)
    assert res["sessions_per_replica"] == [len({r.session_id for r in records})]
    assert lines and "ok=" in lines[-1]

    # Requests are OpenAI streaming requests carrying the session id header.
    first = a.received[0]
    assert first["body"]["stream"] is True
    assert first["body"]["stream_options"] == {"include_usage": True}
    assert "user" not in first["body"] and "session_id" not in first["body"]
    sessions = {r["headers"]["x-session-id"] for r in a.received}
    assert sessions == {r.session_id for r in records} and len(sessions) >= 4
    # Closed loop: each next turn carries the server's previous reply.
    by_session: dict[str, list[dict[str, Any]]] = {}
    for r in a.received:
        by_session.setdefault(r["headers"]["x-session-id"], []).append(r["body"])
    assert any(
        any(m["role"] == "assistant" and m["content"] == "w0xw1xw2xw3x" for m in body["messages"])
        for bodies in by_session.values() for body in bodies
    )


async def test_several_targets_round_robin_and_no_session_header(serve: Any) -> None:
    """Two routers in front of one fleet take the requests in turn; with session_header off no
    request carries a session id (the router sees keyless requests)."""
    a, b = FakeOpenAI(replica="r0"), FakeOpenAI(replica="r1")
    url_a, url_b = await serve(a), await serve(b)
    report = await run_load([url_a, url_b], "tiny", users=2, duration_s=0.8, seed=5,
                            progress=lambda line: None, session_header=False)
    res = report["results"]["target"]
    assert res["requests_ok"] == len(a.received) + len(b.received) and res["requests_failed"] == 0
    assert abs(len(a.received) - len(b.received)) <= 1
    assert report["workload"]["session_header"] is False
    for r in a.received + b.received:
        assert "x-session-id" not in r["headers"]


async def test_failures_are_counted(serve: Any) -> None:
    fake = FakeOpenAI(fail_every=4, sse_error_every=7)
    url = await serve(fake)
    records: list[RequestRecord] = []
    report = await run_load(url, "tiny", users=3, duration_s=1.0, seed=2, progress=lambda line: None,
                            records_out=records)
    res = report["results"]["target"]
    assert res["requests_failed"] > 0 and res["requests_ok"] > 0
    assert res["requests_ok"] + res["requests_failed"] == len(fake.received) == len(records)
    errors = {r.error.split(":")[0] for r in records if not r.ok}
    assert errors == {"HTTP 500", "SSE error"}
    assert res["cache_hit_rate"] == pytest.approx(fake.ok_cached_tokens / fake.ok_prompt_tokens)
    assert res["load_max_over_mean"] is None  # no metrics URLs given
    # The 500s carry no replica header; the streamed replies do.
    assert res["sessions_per_replica"] == [len({r.session_id for r in records if r.replica})]


async def test_hung_requests_are_cancelled_and_failed_after_drain(serve: Any) -> None:
    fake = FakeOpenAI(hang_every=5)
    url = await serve(fake)
    records: list[RequestRecord] = []
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    report = await run_load(url, "tiny", users=3, duration_s=0.5, seed=3, drain_timeout_s=0.2,
                            progress=lambda line: None, records_out=records)
    assert loop.time() - t0 < 2.0
    res = report["results"]["target"]
    cancelled = [r for r in records if r.error == "cancelled at drain timeout"]
    assert cancelled and res["requests_failed"] == len(cancelled)
    assert res["requests_ok"] + res["requests_failed"] == len(fake.received)


async def test_arrival_rate_and_time_scale(serve: Any) -> None:
    fake = FakeOpenAI(first_token_delay_s=0.02)
    url = await serve(fake)
    records: list[RequestRecord] = []
    report = await run_load(url, "tiny", users=None, arrival_rate=100.0, duration_s=0.6, seed=4,
                            time_scale=10.0, progress=lambda line: None, records_out=records)
    res = report["results"]["target"]
    assert res["requests_ok"] > 0 and res["requests_failed"] == 0
    # 20 ms of wall time before the first token is 0.2 s of model time.
    assert res["ttft_p50_s"] >= 0.2
    assert all(r.e2e_s is not None and r.e2e_s >= r.ttft_s >= 0.2 for r in records)
    assert report["workload"]["arrival_rate"] == 100.0 and report["workload"]["time_scale"] == 10.0


async def test_run_load_argument_checks() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        await run_load("http://127.0.0.1:9", "tiny", users=2, duration_s=1, arrival_rate=1.0)
    with pytest.raises(ValueError, match="exactly one"):
        await run_load("http://127.0.0.1:9", "tiny", users=None, duration_s=1)


async def test_unreachable_target_fails_every_request(closed_port_url: str) -> None:
    report = await run_load(closed_port_url, "tiny", users=1, duration_s=0.3, progress=lambda line: None)
    res = report["results"]["target"]
    assert res["requests_ok"] == 0 and res["requests_failed"] > 0
    assert res["ttft_p50_s"] is None and res["cache_hit_rate"] is None


def test_stderr_progress_plain_lines_when_not_a_tty() -> None:
    out = io.StringIO()
    p = StderrProgress(out, every=2)
    for i in range(5):
        p(f"line {i}")
    p.finish("done")
    assert out.getvalue() == "line 0\nline 2\nline 4\ndone\n"


# -- report.py ------------------------------------------------------------------------------


def _rec(ttft: float, e2e: float, **kw: Any) -> RequestRecord:
    return RequestRecord(session_id=kw.pop("session_id", "s"), ok=kw.pop("ok", True), ttft_s=ttft,
                         e2e_s=e2e, **kw)


def test_percentile_interpolates_like_numpy() -> None:
    xs = [float(i) for i in range(1, 101)]  # 1..100
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 95) == pytest.approx(95.05)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None
    assert percentile([4.0, 1.0, 2.0, 3.0], 0) == 1.0 and percentile([4.0, 1.0, 2.0, 3.0], 100) == 4.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_requests_on_hand_built_records() -> None:
    records = [
        _rec(0.1, 1.1, itl_s=0.01, prompt_tokens=1000, completion_tokens=100, cached_tokens=900,
             replica="a", session_id="s1"),
        _rec(0.2, 2.2, itl_s=0.02, prompt_tokens=2000, completion_tokens=200, cached_tokens=1000,
             replica="a", session_id="s1"),
        _rec(0.3, 0.8, itl_s=0.03, prompt_tokens=3000, completion_tokens=50, cached_tokens=0,
             replica="b", session_id="s2"),
        RequestRecord(session_id="s3", ok=False, error="HTTP 500", prompt_tokens=99999, replica="b"),
    ]
    res = summarize_requests(records, replicas=2, duration_model_s=120.0,
                             load_samples=[[1, 3], [0, 0], [2, 2]])
    assert list(res) == list(RESULT_KEYS)
    assert res["requests_ok"] == 3 and res["requests_failed"] == 1
    assert res["ttft_p50_s"] == pytest.approx(0.2)
    assert res["ttft_p95_s"] == pytest.approx(0.29)
    assert res["ttft_p99_s"] == pytest.approx(0.298)
    assert res["itl_p50_s"] == pytest.approx(0.02)
    assert res["e2e_p95_s"] == pytest.approx(1.1 + 0.9 * (2.2 - 1.1))
    # per-request tokens/s: 100/1.0, 200/2.0, 50/0.5 -> all 100
    assert res["output_tps_per_user"] == pytest.approx(100.0)
    # (6000 prompt + 350 completion) over 2 minutes over 2 replicas; the failure does not count.
    assert res["tokens_per_min_per_replica"] == pytest.approx(6350 / 2 / 2)
    assert res["cache_hit_rate"] == pytest.approx(1900 / 6000)
    # samples [1,3] -> 1.5 and 0.5; [0,0] skipped; [2,2] -> 1.0 and 0.0
    assert res["load_max_over_mean"] == pytest.approx(1.25)
    assert res["load_cv"] == pytest.approx(0.25)
    assert res["sessions_per_replica"] == [1, 2]  # a: s1; b: s2, s3


def test_summarize_requests_without_data() -> None:
    res = summarize_requests([], replicas=1, duration_model_s=60.0)
    assert res["requests_ok"] == 0 and res["sessions_per_replica"] == [] and res["failures"] == []
    assert all(res[k] is None for k in RESULT_KEYS
               if k not in ("requests_ok", "requests_failed", "tokens_per_min_per_replica",
                            "sessions_per_replica", "failures"))
    assert res["tokens_per_min_per_replica"] == 0
    assert load_imbalance([[0, 0]]) == (None, None)
    assert math.isclose(load_imbalance([[5]])[0], 1.0)
    with pytest.raises(ValueError):
        summarize_requests([], replicas=0, duration_model_s=1.0)


async def test_headers_go_with_every_request(serve: Any) -> None:
    fake = FakeOpenAI()
    url = await serve(fake)
    await run_load(url, "tiny", users=2, duration_s=0.5, seed=5, progress=lambda line: None,
                   headers={"Authorization": "Bearer tenant-a", "x-priority": "batch"})
    assert fake.received
    assert all(r["headers"]["authorization"] == "Bearer tenant-a" and r["headers"]["x-priority"] == "batch"
               for r in fake.received)


def test_loadtest_refuses_a_malformed_header(capsys: Any) -> None:
    from kvrouter.cli import main

    assert main(["loadtest", "--target", "http://127.0.0.1:9", "--users", "1", "--duration", "1",
                 "--header", "no-colon-here"]) == 2
    assert "want 'NAME: VALUE'" in capsys.readouterr().err


async def test_prompt_rendering_is_not_inside_the_measured_ttft(serve: Any, monkeypatch: Any) -> None:
    """Rendering a long prompt costs the driver tens of ms; it happens before the request's clock
    starts and off the event loop. The driver's clock jumps 100 s while the text is rendered: a
    request stamped before rendering would report that in its TTFT."""
    import threading

    from kvrouter.loadtest import driver
    from kvrouter.loadtest.turn_request import Segment, TurnRequest

    jump = {"s": 0.0}
    render_threads: list[threading.Thread] = []

    class SlowToRender(Segment):
        def text(self) -> str:
            render_threads.append(threading.current_thread())
            jump["s"] += 100.0
            return "def f(x): return x\n" * 8

    class OneTurn:
        def __init__(self) -> None:
            self.sent = False

        def next_requests(self, replies: Any) -> list[TurnRequest]:
            if self.sent:
                return []
            self.sent = True
            segs = (SlowToRender("user", 40, "k"),)
            return [TurnRequest("s0", 0, 0, 1, segs, 8, 4, 0.5, False, None, False, 40, 0)]

    monkeypatch.setattr(driver._Run, "now", lambda self: self.loop.time() + jump["s"])
    fake = FakeOpenAI()
    url = await serve(fake)
    records: list[RequestRecord] = []
    await run_load(url, "tiny", users=None, arrivals=[(0.0, OneTurn())], duration_s=1000.0,
                   progress=lambda line: None, records_out=records)
    [rec] = records
    assert rec.ok and fake.received[0]["body"]["messages"][0]["content"].startswith("def f(x)")
    assert rec.start_s >= 100.0  # stamped after the text existed
    assert rec.ttft_s is not None and rec.ttft_s < 100.0 and rec.e2e_s < 100.0
    assert render_threads and threading.main_thread() not in render_threads


class _OneTurn:
    """A session of one request whose only message is ``segment``."""

    def __init__(self, session_id: str, segment: Any) -> None:
        self.session_id, self.segment, self.sent = session_id, segment, False

    def next_requests(self, replies: Any) -> list[Any]:
        from kvrouter.loadtest.turn_request import TurnRequest

        if self.sent:
            return []
        self.sent = True
        return [TurnRequest(self.session_id, 0, 0, 1, (self.segment,), 8, 4, 0.5, False, None, False, 40, 0)]


async def test_a_body_that_cannot_be_rendered_is_a_counted_failed_request(serve: Any) -> None:
    """Rendering runs before the request's clock starts, but its failure is still the request's:
    one failed record, the run goes on (it neither dies nor loses the request)."""
    from kvrouter.loadtest.turn_request import Segment

    fake = FakeOpenAI()
    url = await serve(fake)
    records: list[RequestRecord] = []
    report = await run_load(url, "tiny", users=None, arrivals=[(0.0, _OneTurn("s0", Segment("user", 8, "k")))],
                            duration_s=5.0, progress=lambda line: None, records_out=records,
                            extra_body={"not_json": {1, 2}})
    [rec] = records
    assert not rec.ok and rec.error is not None and rec.error.startswith("TypeError")
    assert report["results"]["target"]["requests_failed"] == 1 and fake.received == []


async def test_renders_run_one_at_a_time_in_the_order_sessions_asked(serve: Any) -> None:
    """Two sessions due at once: their bodies are rendered one after the other, in the order the
    sessions asked, so seeded runs send in the same order (and round robin over the targets gives
    each session the same router) whatever the threads' timing."""
    import threading

    from kvrouter.loadtest.turn_request import Segment

    second_started = threading.Event()
    overlapped: list[bool] = []

    class First(Segment):
        def text(self) -> str:
            overlapped.append(second_started.wait(0.5))  # a concurrent render would start now
            return "first\n"

    class Second(Segment):
        def text(self) -> str:
            second_started.set()
            return "second\n"

    fakes = [FakeOpenAI(replica="a"), FakeOpenAI(replica="b")]
    urls = [await serve(f) for f in fakes]
    records: list[RequestRecord] = []
    await run_load(urls, "tiny", users=None, duration_s=5.0, progress=lambda line: None, records_out=records,
                   arrivals=[(0.0, _OneTurn("s0", First("user", 8, "k0"))),
                             (0.0, _OneTurn("s1", Second("user", 8, "k1")))])
    assert overlapped == [False]
    assert {r.session_id: r.replica for r in records} == {"s0": "a", "s1": "b"}
    assert not [t for t in threading.enumerate() if t.name.startswith("kvrouter-render")]  # none left
