"""Closed-loop HTTP load driver for any OpenAI-compatible endpoint (router or replica).

Each session (see :mod:`kvrouter.loadtest.workload`) runs closed loop: think, send its turn
(``k`` concurrent requests on a fan-out), wait for every reply, append the server's actual reply
text to the history, repeat. Sessions come from a fixed number of concurrent ``users`` (each runs
sessions back to back), from Poisson arrivals at ``arrival_rate`` sessions per model-second, or
from a trace's ``arrivals`` (each session starts at its own time).

Requests: ``POST {target}/v1/chat/completions`` with ``stream: true``, ``stream_options:
{"include_usage": true}`` and the header ``x-session-id``
(unless ``session_header=False``). Measured per request: the
``x-kvrouter-replica`` response header if any, and from the stream
(:mod:`kvrouter.loadtest.chat_stream`) TTFT, mean inter-token latency, e2e and usage.
A request's clock starts once its body exists: the prompt text is rendered during the think time
(in a worker thread, off the event loop), so its own TTFT does not include it, and the requests in
flight lose the loop to it only at the GIL's switch intervals. A batch with no think time (a
session's first, in a trace replay at its scheduled time) starts when its render ends.
A request is ok only with HTTP 200, no SSE error event and a final ``data: [DONE]``; anything else
(HTTP error, error event, truncated stream, exception, cancellation at the drain timeout) is a
failure. Every request issued produces exactly one record.

Time scaling: with simulated replicas running ``--time-scale X`` (model time X times faster),
pass ``time_scale=X``: think times are divided by X and every measured duration is multiplied by
X, so reports are in model time. ``duration_s`` and ``drain_timeout_s`` are wall seconds.

Bounded: no new turn starts after ``duration_s``; in-flight requests then get
``drain_timeout_s`` to finish, after which they are cancelled and counted as failed.

While running, each replica's ``/metrics`` is sampled every ``metrics_interval_s``
(:mod:`kvrouter.loadtest.replica_load_sampler`) and ``num_running_reqs`` feeds the load-imbalance
figures (see :mod:`kvrouter.loadtest.report`).
"""


from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvrouter.loadtest.chat_stream import read_chat_stream
from kvrouter.loadtest.progress import ProgressFn, StderrProgress
from kvrouter.loadtest.replica_load_sampler import metrics_url, sample_loads
from kvrouter.loadtest.report import RequestRecord, build_report, summarize_requests
from kvrouter.loadtest.turn_request import TurnRequest
from kvrouter.loadtest.workload import Session, make_session, warm_start_batch
from kvrouter.loadtest.workload_config import WorkloadConfig, load_workload
from kvrouter.router.relay import REPLICA_HEADER  # the router names the serving replica in it

__all__ = ["run_load", "SESSION_HEADER"]

SESSION_HEADER = "x-session-id"


async def _cancel_all(tasks: set[asyncio.Task[None]]) -> None:
    """Cancel session tasks still running (deadline or error) and wait until they are gone."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


class _Run:
    """State of one load run; everything the coroutines share lives here."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        urls: Sequence[str],
        config: WorkloadConfig,
        seed: int,
        time_scale: float,
        model: str,
        extra_body: Mapping[str, Any] | None,
        session_header: bool = True,
    ) -> None:
        self.http = http
        self.urls = list(urls)  # requests go round robin over them (several routers, one fleet)
        self.sent = 0
        self.session_header = session_header
        self.config = config
        self.seed = seed
        self.time_scale = time_scale
        self.model = model
        self.extra_body = dict(extra_body or {})
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.deadline = self.start
        self.records: list[RequestRecord] = []
        self.in_flight = 0
        self.sessions_started = 0
        # One thread renders every body, first asked first done: renders hold the GIL, so more
        # threads would not be faster, only finish (and send) in an order that varies run to run.
        self.renderer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrouter-render")

    def now(self) -> float:
        return self.loop.time()

    def new_session(self) -> Session:
        index = self.sessions_started
        self.sessions_started += 1
        return make_session(self.config, self.seed, index)

    # -- sessions --------------------------------------------------------------------------

    async def user_loop(self, delay_s: float = 0.0, warm_start: bool = False) -> None:
        if delay_s > 0:
            await asyncio.sleep(min(delay_s, max(0.0, self.deadline - self.now())))
        if warm_start and self.now() < self.deadline:
            session = self.new_session()
            # Starts mid-life, at the turn the cluster simulator's session of that seed and index does.
            await self.run_session(session, warm_start_batch(session, self.seed))
        while self.now() < self.deadline:
            await self.run_session(self.new_session())

    async def arrival_loop(self, rate_per_model_s: float) -> None:
        rng = random.Random(f"{self.seed}:arrivals")
        tasks: set[asyncio.Task[None]] = set()
        try:
            while self.now() < self.deadline:
                task = asyncio.create_task(self.run_session(self.new_session()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                gap = rng.expovariate(rate_per_model_s) / self.time_scale
                if self.now() + gap >= self.deadline:
                    break
                await asyncio.sleep(gap)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            await _cancel_all(tasks)

    async def trace_loop(self, arrivals: Sequence[tuple[float, Any]]) -> None:
        """Open loop across sessions: each ``(start model s, session)`` starts at its time."""
        tasks: set[asyncio.Task[None]] = set()
        try:
            for at, session in sorted(arrivals, key=lambda a: a[0]):
                when = self.start + at / self.time_scale
                if when >= self.deadline:
                    break
                if when > self.now():
                    await asyncio.sleep(when - self.now())
                self.sessions_started += 1
                task = asyncio.create_task(self.run_session(session))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            await _cancel_all(tasks)

    async def run_session(self, session: Session, first: list[TurnRequest] | None = None) -> None:
        """Run ``session`` closed loop; ``first``, if given, is its first batch, sent at once."""
        replies: list[str | None] | None = None
        while True:
            batch = first if first is not None else session.next_requests(replies)
            if not batch:
                return
            think = 0.0 if first is not None else batch[0].think_time_s / self.time_scale
            first = None
            due = self.now() + think  # the batch's scheduled start
            if think > 0 and due >= self.deadline:
                await asyncio.sleep(max(0.0, self.deadline - self.now()))
                return
            bodies = await self.render(batch)  # inside the think time, before the clock starts
            if due > self.now():
                await asyncio.sleep(due - self.now())
            if self.now() >= self.deadline:
                return
            replies = list(await asyncio.gather(*(self.one_request(r, b) for r, b in zip(batch, bodies))))

    async def render(self, batch: Sequence[TurnRequest]) -> list[bytes | Exception]:
        """The request bodies of ``batch`` (or the error that rendering one raised: that request
        then fails). Rendering a long prompt's text (100-400 KB, tens of ms of CPU) runs in a
        worker thread: on the event loop it would stall the reads, and so the measured TTFTs, of
        every request in flight; the GIL still passes back to the loop every switch interval.
        Segments keep their text, so the next turn renders only what is new."""
        return await self.loop.run_in_executor(self.renderer, self.bodies, batch)

    def bodies(self, batch: Sequence[TurnRequest]) -> list[bytes | Exception]:
        out: list[bytes | Exception] = []
        for req in batch:
            try:
                out.append(self.body(req))
            except Exception as exc:  # e.g. an extra_body value JSON cannot hold
                out.append(exc)
        return out

    def body(self, req: TurnRequest) -> bytes:
        return orjson.dumps({
            "model": self.model,
            "messages": req.messages,
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        })

    # -- one request -----------------------------------------------------------------------

    async def one_request(self, req: TurnRequest, body: bytes | Exception) -> str | None:
        """Send one streamed request (``body`` already rendered: the clock starts when the text
        exists, so TTFT is the server's and the network's, not the driver's); returns the reply
        text, or None when it failed."""
        ts = self.time_scale
        sent = self.now()
        rec = RequestRecord(
            session_id=req.session_id,
            ok=False,
            start_s=(sent - self.start) * ts,
            prompt_tokens=req.prompt_tokens,
            turn_index=req.turn_index,
            branch_index=req.branch_index,
            is_edit=req.is_edit,
        )
        headers = {"content-type": "application/json"}
        if self.session_header:
            headers[SESSION_HEADER] = req.session_id
        url = self.urls[self.sent % len(self.urls)]
        self.sent += 1
        self.in_flight += 1
        try:
            if isinstance(body, Exception):
                raise body
            async with self.http.post(url, data=body, headers=headers) as resp:
                rec.replica = resp.headers.get(REPLICA_HEADER)
                rec.request_id = resp.headers.get("x-request-id")
                if resp.status != 200:
                    text = await resp.text(errors="replace")
                    rec.error = f"HTTP {resp.status}: {text[:200]}"
                    return None
                return await read_chat_stream(resp, rec, sent, self.now, self.time_scale)
        except asyncio.CancelledError:
            rec.error = "cancelled at drain timeout"
            raise
        except Exception as exc:  # connection errors, bad JSON, timeouts: all count as failed
            rec.error = f"{type(exc).__name__}: {exc}"
            return None
        finally:
            self.in_flight -= 1
            self.records.append(rec)


async def _report_progress(run: _Run, progress: ProgressFn, duration_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        progress(_progress_line(run, duration_s))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


def _progress_line(run: _Run, duration_s: float) -> str:
    elapsed = run.now() - run.start
    frac = min(1.0, elapsed / duration_s) if duration_s > 0 else 1.0
    bar = "#" * int(frac * 20)
    ok = sum(1 for r in run.records if r.ok)
    failed = len(run.records) - ok
    phase = "drain" if elapsed >= duration_s else "load"
    return (
        f"[{bar:<20}] {elapsed:6.1f}/{duration_s:.0f}s {phase} sessions={run.sessions_started} "
        f"in_flight={run.in_flight} ok={ok} failed={failed}"
    )


async def run_load(
    target_url: str | Sequence[str],
    workload: WorkloadConfig | str | Path,
    users: int | None,
    duration_s: float,
    seed: int = 0,
    time_scale: float = 1.0,
    replica_metrics_urls: Sequence[str] = (),
    progress: ProgressFn | None = None,
    *,
    arrival_rate: float | None = None,
    replicas: int | None = None,
    contender: str = "target",
    model: str = "default",
    drain_timeout_s: float = 30.0,
    metrics_interval_s: float = 0.5,
    extra_body: Mapping[str, Any] | None = None,
    records_out: list[RequestRecord] | None = None,
    load_samples_out: list[tuple[float, list[float]]] | None = None,
    ramp_s: float = 0.0,
    warm_start: bool = False,
    warmup_s: float = 0.0,
    arrivals: Sequence[tuple[float, Any]] | None = None,
    headers: Mapping[str, str] | None = None,
    session_header: bool = True,
) -> dict[str, Any]:
    """Drive ``target_url`` for ``duration_s`` wall seconds and return the results contract.

    Exactly one of ``users`` (concurrent closed-loop users) and ``arrival_rate`` (new sessions per
    model-second, Poisson) must be given. ``replicas`` defaults to the number of metrics URLs (or 1).
    ``progress`` receives one status line about every second (default: :class:`StderrProgress`).
    ``extra_body`` is merged into every request body (e.g. ``{"ignore_eos": True}`` for SGLang).
    ``records_out``, if given, receives every :class:`RequestRecord`; ``load_samples_out``, if
    given, every load sample as ``(model seconds since the start, [running requests per replica])``
    in the order of ``replica_metrics_urls``. ``ramp_s`` (model seconds) spreads the users' starts
    evenly over that long instead of starting them all at once (closed-loop ``users`` only).
    ``warm_start`` starts each user's first session at a random point of its life (turns skipped
    without being sent, as the cluster simulator does), so contexts have steady-state sizes at once
    while caches are cold; ``warmup_s`` (model seconds) leaves requests started and load samples
    taken before it out of the results (``records_out`` and ``load_samples_out`` still get them).
    ``arrivals`` (trace replay, e.g. :func:`kvrouter.loadtest.traces.trace_sessions`) replaces both
    ``users`` and ``arrival_rate``: each ``(start model s, session)`` starts at its time.
    ``headers`` go with every request (an API key, a priority class, an SLO).
    Several ``target_url`` (routers in front of one fleet) take requests round robin.
    ``session_header=False`` leaves the session header out: routers see keyless requests.
    """
    if arrivals is not None:
        if users is not None or arrival_rate is not None:
            raise ValueError("give only one of users, arrival_rate and arrivals")
    elif (users is None) == (arrival_rate is None):
        raise ValueError("give exactly one of users and arrival_rate")
    if users is not None and users < 1:
        raise ValueError("users must be >= 1")
    if arrival_rate is not None and arrival_rate <= 0:
        raise ValueError("arrival_rate must be > 0")
    if time_scale <= 0 or duration_s <= 0:
        raise ValueError("time_scale and duration_s must be > 0")
    if ramp_s < 0 or warmup_s < 0:
        raise ValueError("ramp_s and warmup_s must be >= 0")
    config = workload if isinstance(workload, WorkloadConfig) else load_workload(workload)
    n_replicas = replicas if replicas is not None else max(1, len(replica_metrics_urls))
    if progress is None:
        progress = StderrProgress()

    targets = [target_url] if isinstance(target_url, str) else list(target_url)
    if not targets:
        raise ValueError("give at least one target_url")
    urls = [t.rstrip("/") + "/v1/chat/completions" for t in targets]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
    samples: list[list[float]] = []
    sample_times: list[float] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as http:
        run = _Run(http, urls, config, seed, time_scale, model, extra_body, session_header)
        run.deadline = run.start + duration_s
        stop = asyncio.Event()
        background = [asyncio.create_task(_report_progress(run, progress, duration_s, stop))]
        if replica_metrics_urls:
            metrics_urls = [metrics_url(u) for u in replica_metrics_urls]
            background.append(
                asyncio.create_task(
                    sample_loads(
                        http, metrics_urls, metrics_interval_s, stop, samples, sample_times,
                        lambda: (run.now() - run.start) * time_scale,
                    )
                )
            )
        if users is not None:
            # user i starts i/users of the ramp after the start (ramp_s is model time)
            workers = [
                asyncio.create_task(run.user_loop(i * ramp_s / users / time_scale, warm_start)) for i in range(users)
            ]
        elif arrivals is not None:
            workers = [asyncio.create_task(run.trace_loop(arrivals))]
        else:
            workers = [asyncio.create_task(run.arrival_loop(arrival_rate))]  # type: ignore[arg-type]
        try:
            _, pending = await asyncio.wait(workers, timeout=duration_s + drain_timeout_s)
            for task in pending:
                task.cancel()
            outcomes = await asyncio.gather(*workers, return_exceptions=True)
        finally:
            for task in workers:
                task.cancel()
            stop.set()
            await asyncio.gather(*background, return_exceptions=True)
            end = run.now()
            run.renderer.shutdown(cancel_futures=True)  # waits for a render whose request was cancelled
        errors = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError)]
        if errors:
            raise errors[0]

    final = _progress_line(run, duration_s)
    finish = getattr(progress, "finish", None)
    if callable(finish):
        finish(final)
    else:
        progress(final)
    if records_out is not None:
        records_out.extend(run.records)
    if load_samples_out is not None:
        load_samples_out.extend(zip(sample_times, samples))
    measured = [r for r in run.records if r.start_s >= warmup_s] if warmup_s > 0 else run.records
    kept = [v for t, v in zip(sample_times, samples) if t >= warmup_s] if warmup_s > 0 else samples
    results = summarize_requests(
        measured, n_replicas, max(0.0, (end - run.start) * time_scale - warmup_s), kept
    )
    workload_info = {
        **config.model_dump(mode="json"),
        "seed": seed,
        "users": users,
        "arrival_rate": arrival_rate,
        "duration_s": duration_s,
        "time_scale": time_scale,
        "replicas": n_replicas,
        "ramp_s": ramp_s,
        "warm_start": warm_start,
        "warmup_s": warmup_s,
        **({} if session_header else {"session_header": False}),
        **({"trace_sessions": len(arrivals)} if arrivals is not None else {}),
    }
    return build_report(workload_info, {contender: results})
