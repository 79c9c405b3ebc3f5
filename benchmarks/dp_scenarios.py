"""The data-plane scenarios of benchmarks/dataplane.py: clients and what they time.

Every scenario takes `targets` (name -> base URL) and interleaves them so machine noise hits all
alike. Times are seconds unless a key says otherwise.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

CHAT_PATH = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello"}]
CHAT = {"model": "bench", "messages": MESSAGES}
_T = re.compile(rb'"t":(\d+)')


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    return {"p50_ms": pct(values, 0.5) * 1e3, "p99_ms": pct(values, 0.99) * 1e3,
            "max_ms": max(values) * 1e3 if values else float("nan"), "n": len(values)}


# -- /proc ----------------------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and all its live descendants (every thread), from /proc."""
    kids = _children()
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
        todo.extend(kids.get(p, ()))
    return total / _TICK


# -- (a) streaming C=1: TTFB and total, three clients on keep-alive connections -------------------
def stream_body(chunks: int, interval_ms: float = 0, messages: list[dict[str, str]] = MESSAGES,
                ) -> dict[str, Any]:
    return {**CHAT, "messages": messages, "stream": True, "max_tokens": chunks,
            "metadata": {"interval_ms": str(interval_ms)}}


_WORDS = ("def", "return", "self", "import", "class", "for", "in", "if", "else", "None", "value",
          "request", "router", "replica", "prefix", "async", "await", "(", ")", ":", "=", "\n    ")


def code_text(rng: random.Random, size: int) -> str:
    """`size` characters of code-like words."""
    out: list[str] = []
    n = 0
    while n < size:
        word = rng.choice(_WORDS)
        out.append(word)
        n += len(word) + 1
    return " ".join(out)[:size]


class Conversation:
    """An append-only chat that starts at ~`start_bytes`: each `next_turn` adds an assistant
    reply and a user message of `turn_bytes` together, as a coding agent's next request does."""

    def __init__(self, rng: random.Random, start_bytes: int, turn_bytes: int) -> None:
        self.rng = rng
        self.turn_bytes = turn_bytes
        self.messages: list[dict[str, str]] = [{"role": "system", "content": code_text(rng, 20_000)}]
        size = 20_000
        while size < start_bytes:
            self.messages.append({"role": "user", "content": code_text(rng, turn_bytes // 2)})
            self.messages.append({"role": "assistant", "content": code_text(rng, turn_bytes // 2)})
            size += turn_bytes
        self.messages.append({"role": "user", "content": code_text(rng, turn_bytes // 2)})

    def next_turn(self) -> list[dict[str, str]]:
        self.messages.append({"role": "assistant", "content": code_text(self.rng, self.turn_bytes // 2)})
        self.messages.append({"role": "user", "content": code_text(self.rng, self.turn_bytes // 2)})
        return self.messages


async def _aiohttp_stream(session: aiohttp.ClientSession, url: str, chunks: int,
                          messages: list[dict[str, str]] = MESSAGES) -> tuple[float, float]:
    start = time.perf_counter()
    async with session.post(url + CHAT_PATH, json=stream_body(chunks, 0, messages)) as resp:
        assert resp.status == 200, resp.status
        await resp.content.readany()
        first = time.perf_counter() - start
        while await resp.content.readany():
            pass
    return first, time.perf_counter() - start


async def _httpx_stream(client: Any, url: str, chunks: int,
                        messages: list[dict[str, str]] = MESSAGES) -> tuple[float, float]:
    start = time.perf_counter()
    async with client.stream("POST", url + CHAT_PATH, json=stream_body(chunks, 0, messages)) as resp:
        assert resp.status_code == 200, resp.status_code
        first = None
        async for _ in resp.aiter_raw():
            if first is None:
                first = time.perf_counter() - start
    return first or float("nan"), time.perf_counter() - start


def _openai_stream(client: Any, chunks: int,
                   messages: list[dict[str, str]] = MESSAGES) -> tuple[float, float]:
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model="bench", messages=messages, stream=True, max_tokens=chunks)
    first = None
    for _ in stream:
        if first is None:
            first = time.perf_counter() - start
    return first or float("nan"), time.perf_counter() - start


async def streaming_c1(targets: dict[str, str], n: int, chunks: int,
                       clients: Sequence[str], prompt_kb: int = 0) -> dict[str, dict[str, Any]]:
    """n requests per (client, target), interleaved target by target, on keep-alive connections.
    With `prompt_kb`, each request is the next turn of one of 4 append-only conversations (per
    client and target) that start at ~`prompt_kb` KB and grow by 2 KB a turn; else "hello"."""
    import httpx
    import openai

    samples: dict[tuple[str, str], list[tuple[float, float]]] = {
        (c, t): [] for c in clients for t in targets}
    session = aiohttp.ClientSession()
    hx = httpx.AsyncClient(timeout=30)
    oa = {t: openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=30)
          for t, url in targets.items()}
    rng = random.Random(0)
    conversations = {(c, t): [Conversation(rng, prompt_kb * 1000, 2000) for _ in range(4)]
                     for c in clients for t in targets} if prompt_kb else {}
    turns = {key: 0 for key in conversations}

    def messages(c: str, t: str) -> list[dict[str, str]]:
        if not prompt_kb:
            return MESSAGES
        turns[c, t] += 1
        return conversations[c, t][turns[c, t] % 4].next_turn()

    runners: dict[str, Callable[[str, str], Any]] = {
        "aiohttp": lambda t, url: _aiohttp_stream(session, url, chunks, messages("aiohttp", t)),
        "httpx": lambda t, url: _httpx_stream(hx, url, chunks, messages("httpx", t)),
        "openai": lambda t, url: asyncio.to_thread(_openai_stream, oa[t], chunks, messages("openai", t)),
    }
    try:
        for i in range(n + 5):  # the first 5 rounds warm the connections and are dropped
            for c in clients:
                for t, url in targets.items():
                    sample = await runners[c](t, url)
                    if i >= 5:
                        samples[(c, t)].append(sample)
    finally:
        await session.close()
        await hx.aclose()
        for client in oa.values():
            client.close()
    out: dict[str, dict[str, Any]] = {}
    for (c, t), rows in samples.items():
        out.setdefault(c, {})[t] = {
            "ttfb": summary_ms([r[0] for r in rows]), "total": summary_ms([r[1] for r in rows])}
    return out


# -- (b) streaming C=64, chunks paced: per-chunk delivery latency and inter-chunk gaps -----------
async def _paced_stream(session: aiohttp.ClientSession, url: str, chunks: int, interval_ms: float,
                        latency: list[float], gaps: list[float]) -> None:
    async with session.post(url + CHAT_PATH, json=stream_body(chunks, interval_ms)) as resp:
        assert resp.status == 200, resp.status
        prev = None
        while True:
            event = await resp.content.readuntil(b"\n\n")
            if not event or event.startswith(b"data: [DONE]"):
                break
            now = time.monotonic_ns()
            m = _T.search(event)
            if m is not None:
                latency.append((now - int(m.group(1))) / 1e9)
            if prev is not None:
                gaps.append((now - prev) / 1e9)
            prev = now
        await resp.read()


async def paced_streams(targets: dict[str, str], concurrency: int, chunks: int, interval_ms: float,
                        rounds: int) -> dict[str, dict[str, Any]]:
    latency: dict[str, list[float]] = {t: [] for t in targets}
    gaps: dict[str, list[float]] = {t: [] for t in targets}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        for r in range(rounds + 1):  # round 0 opens the connections and is dropped
            for t, url in targets.items():
                lat: list[float] = []
                gap: list[float] = []
                await asyncio.gather(*(_paced_stream(session, url, chunks, interval_ms, lat, gap)
                                       for _ in range(concurrency)))
                if r:
                    latency[t] += lat
                    gaps[t] += gap
    return {t: {"chunk_latency": summary_ms(latency[t]), "gap": summary_ms(gaps[t])} for t in targets}


# -- (c) non-streaming requests/s at C=16 ---------------------------------------------------------
async def _closed_loop(one: Callable[[], Awaitable[None]], concurrency: int, seconds: float,
                       on_start: Callable[[], None]) -> tuple[float, int]:
    """`concurrency` workers, each sending one request after another until `seconds` are up:
    (requests/s, requests done)."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await one()
            done += 1
    on_start()
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start), done


async def _rps_aiohttp(url: str, concurrency: int, seconds: float,
                      on_start: Callable[[], None] = lambda: None) -> tuple[float, int]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            async with session.post(url + CHAT_PATH, json=CHAT) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
        await asyncio.gather(*(one() for _ in range(concurrency)))  # warm the connections
        return await _closed_loop(one, concurrency, seconds, on_start)


async def _rps_httpx(url: str, concurrency: int, seconds: float,
                    on_start: Callable[[], None] = lambda: None) -> tuple[float, int]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        async def one() -> None:
            resp = await client.post(url + CHAT_PATH, json=CHAT)
            assert resp.status_code == 200, resp.status_code
        await asyncio.gather(*(one() for _ in range(concurrency)))  # warm the connections
        return await _closed_loop(one, concurrency, seconds, on_start)


class _LeanClient(asyncio.Protocol):
    """One keep-alive connection sending the same request again as soon as each answer ends:
    callbacks only, responses parsed by httptools. A client this cheap leaves the CPU to the
    router, which is what the --workers scaling section must load."""

    def __init__(self, request: bytes, deadline: float, done: asyncio.Future[None]) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.request, self.deadline, self.done, self.count = request, deadline, done, 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        assert self.parser.get_status_code() == 200, self.parser.get_status_code()
        self.count += 1
        if time.perf_counter() < self.deadline:
            self.transport.write(self.request)  # type: ignore[attr-defined]
        elif not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost: {exc}"))


async def rps_lean(url: str, concurrency: int, seconds: float,
                   on_start: Callable[[], None] = lambda: None) -> tuple[float, int]:
    """Requests/s of `concurrency` lean keep-alive connections, each with its own session id."""
    import orjson

    host, port = url.removeprefix("http://").split(":")
    body = orjson.dumps(CHAT)
    loop = asyncio.get_running_loop()
    requests = [(f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"X-Session-Id: bench-{i}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
                for i in range(concurrency)]
    await rps_lean_run(loop, host, int(port), requests, 0.5)  # warm: connections, sessions
    on_start()
    start = time.perf_counter()
    done = await rps_lean_run(loop, host, int(port), requests, seconds)
    return done / (time.perf_counter() - start), done


async def rps_lean_run(loop: asyncio.AbstractEventLoop, host: str, port: int, requests: list[bytes],
                       seconds: float) -> int:
    deadline = time.perf_counter() + seconds
    clients = []
    for request in requests:
        _, client = await loop.create_connection(
            lambda r=request: _LeanClient(r, deadline, loop.create_future()), host, port)
        clients.append(client)
    try:
        await asyncio.gather(*(c.done for c in clients))
    finally:
        for c in clients:
            c.transport.close()
    return sum(c.count for c in clients)


async def nonstreaming_rps(targets: dict[str, str], concurrency: int, seconds: float, rounds: int,
                           clients: Sequence[str], pids: dict[str, int] | None = None,
                           ) -> dict[str, dict[str, Any]]:
    """Requests/s per (client, target), ABBA-ordered runs; with `pids`, also the CPU each target's
    process tree spent per request (microseconds) over its runs."""
    run = {"aiohttp": _rps_aiohttp, "httpx": _rps_httpx, "lean": rps_lean}
    rates: dict[str, dict[str, list[float]]] = {c: {t: [] for t in targets} for c in clients}
    cpu: dict[str, dict[str, list[float]]] = {c: {t: [0.0, 0.0] for t in targets} for c in clients}
    for r in range(rounds):
        names = list(targets) if r % 2 == 0 else list(reversed(targets))  # ABBA: drift hits all
        for c in clients:
            for t in names:
                pid = (pids or {}).get(t)
                mark = [0.0]

                def start(pid: int | None = pid, mark: list[float] = mark) -> None:
                    mark[0] = cpu_seconds(pid) if pid else 0.0
                rate, done = await run[c](targets[t], concurrency, seconds, start)
                rates[c][t].append(rate)
                if pid:
                    cpu[c][t][0] += cpu_seconds(pid) - mark[0]
                    cpu[c][t][1] += done
    return {c: {t: {"rps": statistics.median(v), "runs": v,
                    "cpu_us_per_request": (cpu[c][t][0] / cpu[c][t][1] * 1e6
                                           if cpu[c][t][1] else None)}
                for t, v in per.items()}
            for c, per in rates.items()}


# -- (d) many slow streams: router CPU per 1000 relayed chunks ------------------------------------
class _Stream(asyncio.Protocol):
    """One raw HTTP/1.1 streaming request; counts SSE events ("\\n\\n") as they arrive."""

    def __init__(self, request: bytes, done: asyncio.Future[None]) -> None:
        self.request = request
        self.done = done
        self.events = 0
        self.last = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.events += (self.last + data).count(b"\n\n")
        self.last = data[-1:] if data[-1:] == b"\n" and data[-2:] != b"\n\n" else b""
        if b"data: [DONE]" in data:
            self.events -= 1
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def slow_streams(url: str, cpu_pid: int, streams: int, chunks: int, interval_ms: float,
                       stagger_s: float) -> dict[str, Any]:
    """`streams` concurrent streams of `chunks` events `interval_ms` apart (fresh connections);
    CPU seconds of `cpu_pid` (and its children) over the run, per 1000 chunks received."""
    from yarl import URL

    u = URL(url)
    body = (b'{"model":"bench","messages":[{"role":"user","content":"hello"}],"stream":true,'
            b'"max_tokens":%d,"metadata":{"interval_ms":"%g"}}' % (chunks, interval_ms))
    request = (b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
               % (CHAT_PATH.encode(), u.host.encode(), u.port, len(body), body))
    loop = asyncio.get_running_loop()
    protos: list[_Stream] = []
    waits: list[asyncio.Future[None]] = []
    cpu0, t0 = cpu_seconds(cpu_pid), time.perf_counter()
    for _ in range(streams):
        done: asyncio.Future[None] = loop.create_future()
        proto = _Stream(request, done)
        await loop.create_connection(lambda p=proto: p, u.host, u.port)
        protos.append(proto)
        waits.append(done)
        if stagger_s:
            await asyncio.sleep(stagger_s)
    await asyncio.wait_for(asyncio.gather(*waits), timeout=chunks * interval_ms / 1000 * 4 + 60)
    wall, cpu = time.perf_counter() - t0, cpu_seconds(cpu_pid) - cpu0
    received = sum(p.events for p in protos)
    ideal = stagger_s * streams + chunks * interval_ms / 1000
    return {"streams": streams, "chunks_received": received, "chunks_expected": streams * chunks,
            "wall_s": wall, "ideal_wall_s": ideal, "cpu_s": cpu,
            "cpu_s_per_1000_chunks": cpu / received * 1000 if received else float("nan"),
            "cpu_util": cpu / wall}
