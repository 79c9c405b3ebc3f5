"""What a fault test observed, on both sides: every request a client sent and what came back, and
what each replica says it received, completed and aborted.

A request ends one of four ways for its client: a **complete** response (200 and, for a stream, its
events then one ``data: [DONE]``), a **clean error** (an error status with an OpenAI-shaped
``{"error": {...}}`` body, or an SSE ``data: {"error": ...}`` event followed by ``data: [DONE]``),
**left** (the client hung up on purpose) or **nothing** (a hang, a truncated stream without an
error, a body that is not an error, a second [DONE]). Which timeout or path produced a clean error
does not matter; that the client got one does.

*Lost* = requests that ended with nothing (or were never given an outcome by the test), plus every
disagreement with the replicas: completions the replicas counted that no client received as complete
(or the reverse), and requests still running on a replica when the test is over.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

COMPLETE, CLEAN_ERROR, LEFT, NOTHING = "complete", "clean_error", "left", "nothing"
_LOOPBACK_URL = re.compile(r"http://127\.0\.0\.1:\d+")


def _stable(message: str | None) -> str | None:
    """Messages as saved: the test servers' random ports replaced, so runs group and diff alike."""
    return None if message is None else _LOOPBACK_URL.sub("http://127.0.0.1:PORT", message)


@dataclass(frozen=True)
class Outcome:
    kind: str
    status: int | None = None
    message: str | None = None
    replica: str | None = None
    retry_after: str | None = None

    @property
    def short(self) -> str:
        """The coarse outcome tests assert on: 'ok', 'error', 'left' or 'broken'."""
        return {COMPLETE: "ok", CLEAN_ERROR: "error", LEFT: "left"}.get(self.kind, "broken")


def _error_of(body: bytes) -> tuple[int | None, str] | None:
    """(code, message) of an OpenAI-shaped error body or SSE error event payload, else None."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return None
    code = err.get("code")
    return (code if isinstance(code, int) else None), err["message"]


def outcome_of_body(status: int, body: bytes, replica: str | None = None) -> Outcome:
    """The outcome of a fully read non-streaming answer."""
    if status == 200:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return Outcome(NOTHING, status, "200 with a body that is not JSON", replica)
        if isinstance(data, dict) and data.get("choices"):
            return Outcome(COMPLETE, status, None, replica)
        return Outcome(NOTHING, status, "200 without choices", replica)
    err = _error_of(body)
    if err is None:
        return Outcome(NOTHING, status, f"{status} without an OpenAI-shaped error body", replica)
    return Outcome(CLEAN_ERROR, status, err[1], replica)


def outcome_of_sse(data: bytes, replica: str | None = None) -> Outcome:
    """The outcome of a fully read 200 event stream."""
    if data.count(b"data: [DONE]") != 1 or not data.endswith(b"data: [DONE]\n\n"):
        return Outcome(NOTHING, 200, "stream without exactly one final data: [DONE]", replica)
    for event in data.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"error"' in event:
            err = _error_of(event[len(b"data: "):])
            if err is not None:
                return Outcome(CLEAN_ERROR, err[0], err[1], replica)
    return Outcome(COMPLETE, 200, None, replica)


async def read_outcome(resp: aiohttp.ClientResponse, first: bytes = b"", timeout: float = 30) -> Outcome:
    """Read the rest of ``resp`` (``first``: bytes already read from it) and classify it."""
    replica = resp.headers.get("x-kvrouter-replica")
    try:
        rest = await asyncio.wait_for(resp.read(), timeout)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Outcome(NOTHING, resp.status, f"{type(exc).__name__} while reading", replica)
    if resp.status == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
        return outcome_of_sse(first + rest, replica)
    outcome = outcome_of_body(resp.status, first + rest, replica)
    return Outcome(outcome.kind, outcome.status, outcome.message, replica, resp.headers.get("Retry-After"))


@dataclass
class Request:
    label: str
    outcome: Outcome | None = None
    inference: bool = True  # False: answered by the router itself (/health, /v1/models), no replica count
    def got(self, outcome: Outcome) -> Outcome:
        assert self.outcome is None, f"request {self.label} answered twice"
        self.outcome = outcome
        return outcome

    def left(self) -> Outcome:
        return self.got(Outcome(LEFT))


@dataclass
class ReplicaCounts:
    """One replica's own view. ``errors``: requests it answered with an error status;
    ``running``: still in flight when read. ``gone``: the process died (counts as of its death;
    whatever it was running died with it)."""

    name: str
    received: int
    completed: int
    aborted: int
    errors: int = 0
    running: int = 0
    gone: bool = False


@dataclass
class FaultRecord:
    """The ledger of one fault test (the ``fault_record`` fixture)."""

    requests: list[Request] = field(default_factory=list)
    replicas: list[ReplicaCounts] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def send(self, label: str = "", inference: bool = True) -> Request:
        """Call before the request goes out; give it an outcome with ``got`` or ``left``."""
        req = Request(label or f"r{len(self.requests)}", inference=inference)
        self.requests.append(req)
        return req

    async def request(self, client: aiohttp.ClientSession, url: str, body: Any = None, *,
                      data: bytes | None = None, headers: dict[str, str] | None = None,
                      label: str = "", timeout: float = 30, method: str = "POST") -> Outcome:
        """Send one request and record what came back (never raises for a failed request)."""
        req = self.send(label)
        try:
            async with asyncio.timeout(timeout):
                async with client.request(method, url, json=body if data is None else None, data=data,
                                          headers=headers) as resp:
                    return req.got(await read_outcome(resp, timeout=timeout))
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            return req.got(Outcome(NOTHING, None, f"{type(exc).__name__}: {exc}"))

    async def observe(self, resp: aiohttp.ClientResponse, first: bytes = b"") -> Outcome:
        """Record one request whose response the test holds, reading it to its end (the body stays
        readable through ``resp``)."""
        req = self.send()
        return req.got(await read_outcome(resp, first))

    def replica(self, counts: ReplicaCounts) -> None:
        self.replicas.append(counts)

    def note(self, text: str) -> None:
        self.notes.append(text)

    # -- the verdict ---------------------------------------------------------------------------
    def _kinds(self) -> Counter[str]:
        return Counter(r.outcome.kind if r.outcome else NOTHING for r in self.requests)

    def _complete_inference(self) -> int:
        return sum(1 for r in self.requests if r.inference and r.outcome and r.outcome.kind == COMPLETE)

    def disagreements(self) -> list[str]:
        if not self.replicas:
            return []
        out = []
        completed = sum(r.completed for r in self.replicas)
        complete = self._complete_inference()
        if completed != complete:
            out.append(f"replicas completed {completed} requests, clients received {complete} complete")
        for r in self.replicas:
            if r.running and not r.gone:
                out.append(f"{r.name}: {r.running} requests still running after the test")
        return out

    @property
    def lost(self) -> int:
        if not self.requests:
            return 0
        completed = sum(r.completed for r in self.replicas)
        running = sum(r.running for r in self.replicas if not r.gone)
        mismatch = abs(completed - self._complete_inference()) if self.replicas else 0
        return self._kinds()[NOTHING] + mismatch + running

    def row(self) -> dict[str, Any]:
        kinds = self._kinds()
        errors = Counter((r.outcome.status, _stable(r.outcome.message)) for r in self.requests
                         if r.outcome and r.outcome.kind == CLEAN_ERROR)
        nothing = Counter(_stable(r.outcome.message) if r.outcome else "no outcome recorded"
                          for r in self.requests if not r.outcome or r.outcome.kind == NOTHING)
        return {
            "client": {
                "sent": len(self.requests), "complete": kinds[COMPLETE], "clean_errors": kinds[CLEAN_ERROR],
                "left_on_purpose": kinds[LEFT], "nothing": kinds[NOTHING],
                "errors": [{"status": s, "message": m, "count": n}
                           for (s, m), n in sorted(errors.items(), key=lambda kv: (-kv[1], str(kv[0])))],
                "nothing_reasons": [{"reason": m, "count": n} for m, n in nothing.most_common()],
            },
            "replicas": None if not self.replicas else {
                "received": sum(r.received for r in self.replicas),
                "completed": sum(r.completed for r in self.replicas),
                "aborted": sum(r.aborted for r in self.replicas),
                "errors": sum(r.errors for r in self.replicas),
                "running": sum(r.running for r in self.replicas if not r.gone),
                "each": [{**vars(r), "name": _stable(r.name)} for r in self.replicas],
            },
            "disagreements": self.disagreements(),
            "lost": self.lost if self.requests else None,
            "notes": "; ".join(self.notes),
        }


# -- replica counts ------------------------------------------------------------------------------

def fake_counts(name: str, upstream: Any) -> ReplicaCounts:
    """tests/fakes.FakeUpstream's own counts."""
    return ReplicaCounts(name, len(upstream.requests), upstream.completed, upstream.aborted,
                         upstream.errors, upstream.running)


def sim_counts(name: str, sim: Any) -> ReplicaCounts:
    """An in-process simulated replica (``app[SIM_KEY]``): the model's counters."""
    model = sim.model
    running = len(sim.running_rids())
    done, aborted = model.num_requests_total, model.num_aborted_requests_total
    return ReplicaCounts(name, done + aborted + running, done, aborted, 0, running)


async def sim_proc_counts(name: str, url: str, gone: bool = False) -> ReplicaCounts:
    """A ``kvrouter sim-replica`` process, from its /metrics page."""
    async with aiohttp.ClientSession() as client:
        async with client.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            text = await resp.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sglang:") and " " in line:
            metric = line.split("{", 1)[0].split(" ", 1)[0][len("sglang:"):]
            values[metric] = values.get(metric, 0.0) + float(line.rsplit(" ", 1)[1])
    done = int(values.get("num_requests_total", 0))
    aborted = int(values.get("num_aborted_requests_total", 0))
    running = int(values.get("num_running_reqs", 0) + values.get("num_queue_reqs", 0))
    return ReplicaCounts(name, done + aborted + running, done, aborted, 0, running, gone)
