"""Property-based fuzzing (hypothesis) of request bodies, headers, routes and methods against a live
router on 127.0.0.1 (raw sockets, so invalid UTF-8 and CR/LF reach the server unfiltered).

Properties: the answer is never a 5xx; every 4xx is an OpenAI-shaped JSON error, including the
protocol-level rejections of aiohttp's parser (router/http_errors.py); the router stays healthy (GET /health answers 200 after every example).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouter.router.app import Router
from kvrouter.router.config import parse_config
from kvrouter.router.serve import start_site

from .fakes import FakeUpstream
from .fault_ledger import CLEAN_ERROR, COMPLETE, NOTHING, Outcome, ReplicaCounts

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate"]
MAX_BODY = 256 * 1024


class LiveRouter:
    """A router (and a fake upstream) served from a background thread's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0
        self.router: Router | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        from aiohttp import web

        self.upstream = FakeUpstream(chunks=2)
        self.up_runner = web.AppRunner(self.upstream.app())
        await self.up_runner.setup()
        site = web.TCPSite(self.up_runner, "127.0.0.1", 0)
        await site.start()
        up_url = f"http://127.0.0.1:{self.up_runner.addresses[0][1]}"
        self.router = Router(parse_config({
            "replicas": [up_url], "server": {"max_body_bytes": MAX_BODY},
            "signals": {"source": "health", "interval_s": 0.5},
            "routing": {"allow_target_hint": True},
        }))
        self.runner, self.port = await start_site(self.router, "127.0.0.1", 0)

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.up_runner.cleanup()

    def start(self) -> "LiveRouter":
        self.thread.start()
        assert self.ready.wait(20)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    # -- raw HTTP ------------------------------------------------------------------------------
    def send(self, raw: bytes, timeout: float = 15.0) -> tuple[int, dict[str, str], bytes]:
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            try:
                s.sendall(raw)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server may reject (and close) before reading it all
            data = b""
            try:
                while chunk := s.recv(65536):
                    data += chunk
            except ConnectionResetError:
                pass
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines and lines[0].startswith(b"HTTP/1."), f"no HTTP response: {data[:200]!r}"
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.decode("latin-1").strip().lower()] = v.decode("latin-1").strip()
        return status, headers, body

    def request(self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]] = (), body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        head = [method + b" " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
        head += [k + b": " + v for k, v in headers]
        if body or method in (b"POST", b"PUT", b"PATCH"):
            head.append(b"Content-Length: " + str(len(body)).encode())
        return self.send(b"\r\n".join(head) + b"\r\n\r\n" + body)

    def healthy(self) -> bool:
        status, _, body = self.request(b"GET", b"/health")
        return status == 200 and body == b'{"status":"ok"}'


@pytest.fixture(scope="module")
def live() -> Iterator[LiveRouter]:
    router = LiveRouter().start()
    yield router
    router.stop()


def check(live: LiveRouter, status: int, headers: dict[str, str], body: bytes) -> None:
    assert status < 500, (status, body[:300])
    if 400 <= status < 500:
        assert headers.get("content-type", "").startswith("application/json"), (status, body[:300])
        err = orjson.loads(body)["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str) and err["code"] == status
    assert live.healthy()


json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50)
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=10), kids, max_size=5), max_leaves=30)
KNOWN_FIELDS = ["model", "messages", "prompt", "text", "input_ids", "stream", "session_id", "user",
                "prompt_cache_key", "max_tokens", "stream_options", "target_worker", "sampling_params"]


@st.composite
def request_bodies(draw) -> dict[str, Any]:
    body = draw(st.dictionaries(st.sampled_from(KNOWN_FIELDS) | st.text(max_size=8), json_values, max_size=8))
    if draw(st.booleans()):
        body["messages"] = draw(st.lists(st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]) | st.text(max_size=5),
                                                          json_values, max_size=4), max_size=4))
    return body


def tally(live: LiveRouter, record, before: tuple[int, int, int, int], status: int,
          headers: dict[str, str], body: bytes, stream: bool = False, inference: bool = True) -> None:
    """Record one fuzzed request in the fault ledger: the router's answer as the client saw it (raw
    bytes, so a chunked stream still has its chunk sizes) and what the upstream counted for it."""
    if status == 200:
        done = body.count(b"data: [DONE]")
        whole = done == 1 if stream or b"data: " in body else (b'"choices"' in body or b'"object"' in body
                                                               or b'"status"' in body)
        outcome = Outcome(COMPLETE if whole else NOTHING, 200, None if whole else "200 without a whole answer")
    elif 400 <= status < 500 and headers.get("content-type", "").startswith("application/json"):
        outcome = Outcome(CLEAN_ERROR, status, orjson.loads(body)["error"]["message"])
    else:
        outcome = Outcome(NOTHING, status, f"{status} without an OpenAI-shaped error body")
    record.send(inference=inference).got(outcome)
    up = live.upstream
    deadline = time.monotonic() + 5  # the upstream counts a stream once its last write returned
    while up.running and time.monotonic() < deadline:
        time.sleep(0.005)
    if not record.replicas:
        record.replica(ReplicaCounts("fake upstream", 0, 0, 0))
    counts = record.replicas[0]
    now = (len(up.requests), up.completed, up.aborted, up.errors)
    counts.received += now[0] - before[0]
    counts.completed += now[1] - before[1]
    counts.aborted += now[2] - before[2]
    counts.errors += now[3] - before[3]
    counts.running = up.running


def upstream_now(live: LiveRouter) -> tuple[int, int, int, int]:
    up = live.upstream
    return len(up.requests), up.completed, up.aborted, up.errors


@pytest.mark.fault_matrix(fault="Fuzzed JSON bodies: random structure, wrong types in every known field",
                          clients_saw="200 (forwarded) or 4xx OpenAI-shaped error; never 5xx; /health 200 after each")
@SETTINGS
@given(route=st.sampled_from(ROUTES), body=request_bodies())
def test_fuzz_json_bodies_wrong_types(live, fault_record, route, body):
    before = upstream_now(live)
    status, headers, data = live.request(b"POST", route.encode(), [(b"Content-Type", b"application/json")],
                                         json.dumps(body).encode())
    check(live, status, headers, data)
    tally(live, fault_record, before, status, headers, data, stream=body.get("stream") is True)
    if status == 200 and body.get("stream"):
        assert data.rstrip().endswith(b"0") or b"[DONE]" in data  # chunked stream ended


@pytest.mark.fault_matrix(fault="Fuzzed malformed bodies: random bytes, invalid UTF-8, nesting to 200k levels, truncated JSON",
                          clients_saw="400 OpenAI-shaped error (or 200 when valid); never 5xx; /health 200 after each")
@SETTINGS
@given(route=st.sampled_from(ROUTES), raw=st.one_of(
    st.binary(max_size=2000),
    st.binary(max_size=200).map(lambda b: b'{"messages": "' + b + b'"}'),  # invalid UTF-8 inside JSON
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),  # deeply nested
    st.integers(1, 5_000).map(lambda n: b'{"messages": ' + b"[" * n + b"]" * n + b"}"),
    # the hint field makes the router re-serialise the body (orjson writes at most 254 levels)
    st.integers(1, 1_100).map(lambda n: b'{"target_worker": null, "a": ' + b"[" * n + b"]" * n + b"}"),
    st.integers(1, 100_000).map(lambda n: b'{"a":' * n),  # truncated and nested
    st.sampled_from([b"", b"null", b"[]", b"1", b'"x"', b"NaN", b"{", b'{"stream": true', b"\xef\xbb\xbf{}"]),
))
def test_fuzz_malformed_bodies(live, fault_record, route, raw):
    before = upstream_now(live)
    status, headers, data = live.request(b"POST", route.encode(), [(b"Content-Type", b"application/json")], raw)
    check(live, status, headers, data)
    tally(live, fault_record, before, status, headers, data)


@SETTINGS
@given(route=st.sampled_from(ROUTES), size=st.integers(1, 3 * MAX_BODY), field=st.sampled_from(["content", "model", "session"]))
def test_fuzz_huge_strings(live, route, size, field):
    big = "x" * size
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if field == "content":
        body["messages"][0]["content"] = big
    elif field == "model":
        body["model"] = big
    else:
        body["session_id"] = big
    raw = json.dumps(body).encode()
    status, headers, data = live.request(b"POST", route.encode(), [], raw)
    check(live, status, headers, data)
    if len(raw) > MAX_BODY:
        assert status == 413


header_names = st.sampled_from([b"x-session-id", b"x-request-id", b"Content-Type", b"Authorization", b"x-smg-target-worker",
                                b"x-smg-routing-key", b"Connection", b"Transfer-Encoding", b"Accept-Encoding", b"Expect"]) | \
    st.binary(min_size=1, max_size=20)
header_values = st.binary(max_size=100) | st.sampled_from([b"a\r\nInjected: 1", b"a\rb", b"a\nb", b"\x00", b"\xff\xfe",
                                                           b"chunked", b"close", b"100-continue", b"http://127.0.0.1:1"]) | \
    st.integers(8000, 20000).map(lambda n: b"v" * n)  # oversized


@pytest.mark.fault_matrix(fault="Fuzzed headers: CR/LF/NUL in values, invalid bytes, 8-20 KB values",
                          clients_saw="200 or OpenAI-shaped JSON 4xx (also for lines the HTTP parser refuses); never 5xx; no header injection")
@SETTINGS
@given(route=st.sampled_from(ROUTES + ["/v1/models", "/health"]), headers=st.lists(st.tuples(header_names, header_values), max_size=4))
def test_fuzz_headers_crlf_oversized(live, fault_record, route, headers):
    method = b"GET" if route in ("/v1/models", "/health") else b"POST"
    body = b"" if method == b"GET" else b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    before = upstream_now(live)
    status, resp_headers, data = live.request(method, route.encode(), headers, body)
    check(live, status, resp_headers, data)
    assert "injected" not in resp_headers  # a CR/LF in a value never becomes a header
    tally(live, fault_record, before, status, resp_headers, data, inference=method == b"POST")


@SETTINGS
@given(method=st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"HEAD", b"TRACE", b"CONNECT", b"BREW"]) |
       st.binary(min_size=1, max_size=10),
       path=st.sampled_from([b"/", b"/admin/state", b"/admin/replicas", b"/v1", b"/v1/chat/completions/x", b"/../etc/passwd",
                             b"/v1/chat/completions?x=1", b"//evil", b"/%2e%2e/", b"http://127.0.0.1:1/v1/chat/completions", b"*"]) |
       st.binary(min_size=1, max_size=60).map(lambda b: b"/" + b))
def test_fuzz_unknown_routes_and_methods(live, method, path):
    status, headers, data = live.request(method, path)
    if method == b"HEAD":  # a HEAD answer has no body to check
        assert status < 500 and live.healthy()
    else:
        check(live, status, headers, data)
    if status == 200:  # only real routes answer 200
        assert method in (b"GET", b"HEAD", b"POST")


def test_known_route_wrong_method_and_unknown_route_are_json(live):
    for method, path, want in ((b"GET", b"/v1/chat/completions", 405), (b"DELETE", b"/v1/models", 405),
                               (b"POST", b"/health", 405), (b"GET", b"/admin/state", 404), (b"GET", b"/nope", 404)):
        status, headers, body = live.request(method, path)
        assert status == want and headers["content-type"].startswith("application/json")
        assert orjson.loads(body)["error"]["code"] == want
    assert live.healthy()


@pytest.mark.parametrize("raw", [
    b"GET /health HTTP/1.1\r\nBad Header Line\r\n\r\n",
    b"GET /health HTTP/1.1\r\nX-Big: " + b"v" * 20000 + b"\r\n\r\n",
    b"BR(W /health HTTP/1.1\r\n\r\n",
    b"GET /health HTTP/9.9\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # a TLS ClientHello on the HTTP port
], ids=["bad-header-line", "oversized-header", "bad-method-token", "bad-version", "bad-content-length",
        "length-and-chunked", "tls-on-http-port"])
def test_parser_level_rejections_are_json(live, raw):
    status, headers, body = live.send(raw)
    assert 400 <= status < 500 and headers["content-type"].startswith("application/json")
    err = orjson.loads(body)["error"]
    assert err["code"] == status and err["message"].startswith("malformed HTTP request")
    assert live.healthy()


def test_hint_field_with_deep_nesting_is_a_400(live):
    """Found in review: removing the hint field re-serialises the body, which orjson refuses
    beyond 254 levels of nesting; that was a 500."""
    for depth in (10, 300, 1000, 1100):
        raw = b'{"target_worker": null, "messages": [], "a": ' + b"[" * depth + b"]" * depth + b"}"
        status, headers, body = live.request(b"POST", b"/v1/chat/completions", [], raw)
        assert status == (200 if depth == 10 else 400), (depth, body[:200])
        check(live, status, headers, body)


def test_deep_nesting_wherever_the_router_re_serialises_is_a_400(live):
    """The router also writes JSON back from a prompt's content parts (its prefix hash); orjson
    reads deeper JSON than it writes. A streaming body it asks for usage is not written back
    (the member is added to the client's bytes), so its depth is the replica's to judge, unless
    the client sent its own stream_options, which is replaced by re-serialising."""
    deep = b"[" * 300 + b"]" * 300
    raw = b'{"messages": [{"role": "user", "content": ' + deep + b"}]}"
    status, headers, body = live.request(b"POST", b"/v1/chat/completions", [], raw)
    assert status == 400 and b"nested too deeply" in body, (status, body[:200])
    check(live, status, headers, body)
    raw = b'{"messages": [], "stream": true, "a": ' + deep + b"}"
    status, headers, body = live.request(b"POST", b"/v1/chat/completions", [], raw)
    assert status == 200, (status, body[:200])
    check(live, status, headers, body)
    raw = b'{"messages": [], "stream": true, "stream_options": {}, "a": ' + deep + b"}"
    status, headers, body = live.request(b"POST", b"/v1/chat/completions", [], raw)
    assert status == 400 and b"nested too deeply" in body, (status, body[:200])
    check(live, status, headers, body)


def test_expect_header_regression(live):
    """Found by test_fuzz_headers_crlf_oversized: a non-UTF-8 `Expect` value made aiohttp's own
    Expect handler (which runs before middlewares) fail with a 500."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    for path in (b"/v1/chat/completions", b"/nope", b"/health"):
        for value in (b"\x80", b"\xff\xfe", b"something-else"):
            method = b"GET" if path == b"/health" else b"POST"
            status, headers, data = live.request(method, path, [(b"Expect", value)], body if method == b"POST" else b"")
            assert status == 417 and orjson.loads(data)["error"]["code"] == 417
    status, _, data = live.request(b"POST", b"/v1/chat/completions", [(b"Expect", b"100-continue")], body)
    assert status == 100 and data.startswith(b"HTTP/1.1 200 OK")  # interim 100 Continue, then the answer
    assert live.healthy()
