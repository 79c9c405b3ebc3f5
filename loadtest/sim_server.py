"""``kvrouter sim-replica``: an aiohttp server that answers like one SGLang replica.

The pure :class:`~kvrouter.loadtest.replica_model.ReplicaModel` decides everything that takes
time (queueing, prefill with prefix-cache hits, decode, eviction); this module only gives it a
clock and SGLang's HTTP surface (shapes in ``docs/sglang-fidelity.md``):

* clock: model time = (wall monotonic - start) x ``time_scale``. One driver task sleeps until
  the model's ``next_event_time()`` (in wall time) or until a submit/abort wakes it, calls
  ``advance(now)`` and resolves the waiting requests. Streams poll ``progress(rid, now)`` at
  least every ``stream_interval_s`` of wall time, so tokens arrive over time.
* text: chat messages are rendered with a fixed ChatML-like template and tokenized with
  ``loadtest/tokenizer.encode``; the output is ``tokenizer.synthetic_text`` of the chosen
  length, and the pages a request leaves in the cache are those of ``prompt + output``, so the
  next turn of a conversation (whose history carries this reply) hits them.
* cache namespaces: served model name + ``extra_key`` / ``cache_salt`` / ``lora_path``.
* output length: with ``ignore_eos`` exactly ``max_tokens`` (``max_new_tokens``), else a
  deterministic draw from (seed, rid) capped by it.

Times reported (``e2e_latency``, the latency histograms) are model seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import hashlib
import logging
import math
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from ..metrics import sglang as sg
from ..metrics.kv_events import request_namespace
from . import tokenizer
from .profiles import Profile, load_profile
from .radix_cache import page_keys
from .replica_model import Finished, FirstToken, ReplicaModel, SimRequest
from .sim_kv_publisher import SimKVPublisher, parse_kv_events_config, publisher_from_config

log = logging.getLogger("kvrouter.sim")

SIM_VERSION = "0.0.0+kvrouter.sim"
DEFAULT_CONTEXT_LEN = 262144
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang SamplingParams default
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI / SGLang CompletionRequest default
EOS_TOKEN_ID = 163586  # what `matched_stop` reports for a natural stop
STREAM_INTERVAL_S = 0.02
VALID_LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")

FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


# ----------------------------------------------------------------------------------------------
# chat template
# ----------------------------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                if part.get("type") == "text" or "text" in part:
                    parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def render_chat(messages: list[dict[str, Any]], tools: Any = None) -> str:
    """Deterministic ChatML-style rendering, ending with the assistant prefix.

    Turn 1 rendered + its reply is a text prefix of turn 2 rendered (reply then ``<|im_end|>``).
    """
    out: list[str] = []
    if tools:
        out.append("<|im_start|>tools\n" + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode() + "<|im_end|>\n")
    for m in messages:
        role = str(m.get("role", "user"))
        text = _content_text(m.get("content"))
        if m.get("tool_calls"):
            text += orjson.dumps(m["tool_calls"], option=orjson.OPT_SORT_KEYS).decode()
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def kv_token_ids(route: str, body: dict[str, Any]) -> list[int] | None:
    """The token ids this simulated replica prefills for a request, or None if unknown.

    A router tokenizer plug-in (``kv_events.tokenizer: kvrouter.loadtest.sim_server:kv_token_ids``):
    same chat template and tokenizer as the handlers below, so the router's block hashes equal
    the ones this replica publishes.
    """
    ids: Any = None
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            return tokenizer.encode(render_chat(messages, body.get("tools")))
        return None
    if route == "/v1/completions":
        ids = body.get("prompt")
        if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], (str, list)):
            ids = ids[0]
    elif route == "/generate":
        ids = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
    if isinstance(ids, str):
        return tokenizer.encode(ids)
    if isinstance(ids, list) and ids and all(type(t) is int for t in ids):
        return ids
    return None


# ----------------------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------------------


class _Hist:
    """A histogram we fill ourselves (so an observation can carry a weight, as SGLang's ITL does)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0.0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, weight: float = 1.0, total: float | None = None) -> None:
        i = 0
        for i, b in enumerate(self.bounds):  # noqa: B007
            if value <= b:
                break
        else:
            i = len(self.bounds)
        self.counts[i] += weight
        self.sum += value * weight if total is None else total

    def buckets(self) -> list[tuple[str, float]]:
        out = []
        acc = 0.0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append((_le(b), acc))
        acc += self.counts[-1]
        out.append(("+Inf", acc))
        return out


def _le(b: float) -> str:
    return str(float(b))


class SimCollector:
    """prometheus_client collector: everything is read from the replica at scrape time."""

    def __init__(self, replica: SimReplica) -> None:
        self.r = replica

    def describe(self) -> list:
        return []

    def collect(self):  # noqa: C901 - one flat table
        r = self.r
        r.poll()
        now = r.now()
        load = r.model.load(now)
        p = r.profile
        sched = list(r.scheduler_label_values)
        tok = list(r.tokenizer_label_values)
        spec_on = p.spec_verify_tokens > 1
        hicache = p.host_total_num_tokens > 0
        m = r.model
        gauges: dict[str, float | None] = {
            sg.NUM_RUNNING_REQS: load.num_running_reqs,
            sg.NUM_QUEUE_REQS: load.num_queue_reqs,
            sg.NUM_GRAMMAR_QUEUE_REQS: 0,
            sg.GEN_THROUGHPUT: load.gen_throughput,
            sg.CACHE_HIT_RATE: load.cache_hit_rate,
            sg.DECODE_SUM_SEQ_LENS: r.decode_sum_seq_lens(now),
            sg.TOKEN_USAGE: load.token_usage,
            sg.FULL_TOKEN_USAGE: load.token_usage,
            sg.NUM_USED_TOKENS: load.num_used_tokens,
            sg.KV_AVAILABLE_TOKENS: load.kv_available_tokens,
            sg.KV_EVICTABLE_TOKENS: load.kv_evictable_tokens,
            sg.KV_USED_TOKENS: load.num_used_tokens,
            sg.SPEC_ACCEPT_LENGTH: load.spec_accept_length if spec_on else None,
            sg.SPEC_ACCEPT_RATE: r.spec_accept_rate() if spec_on else None,
            sg.UTILIZATION: load.num_running_reqs / p.max_running_requests,
            sg.MAX_TOTAL_NUM_TOKENS: p.max_total_num_tokens,
            sg.PAGE_SIZE: p.page_size,
            sg.NUM_PAGES: p.max_total_num_tokens // p.page_size,
            sg.CONTEXT_LEN: r.context_len,
            sg.HICACHE_HOST_USED_TOKENS: load.host_used_tokens if hicache else None,
            sg.HICACHE_HOST_TOTAL_TOKENS: load.host_total_tokens if hicache else None,
        }
        counters: dict[str, float | None] = {
            sg.EVICTED_TOKENS_TOTAL: m.evicted_tokens_total if hicache else None,
            sg.LOAD_BACK_TOKENS_TOTAL: m.load_back_tokens_total if hicache else None,
            sg.PROMPT_TOKENS_TOTAL: m.prompt_tokens_total,
            sg.GENERATION_TOKENS_TOTAL: m.generation_tokens_total,
            sg.NUM_REQUESTS_TOTAL: m.num_requests_total,
            sg.NUM_ABORTED_REQUESTS_TOTAL: m.num_aborted_requests_total,
        }
        for spec in sg.METRIC_SPECS:
            name = spec.name()
            values = sched if spec.labels[: len(sg.SCHEDULER_LABELS)] == sg.SCHEDULER_LABELS else tok
            if spec.type == "gauge":
                v = gauges.get(spec.base)
                if v is None:
                    continue
                fam = GaugeMetricFamily(name, spec.help, labels=spec.labels)
                fam.add_metric(values, float(v))
                yield fam
            elif spec.type == "counter":
                if spec.base == sg.CACHED_TOKENS_TOTAL:
                    fam = CounterMetricFamily(name, spec.help, labels=spec.labels)
                    # SGLang increments nothing for a source with zero cached tokens.
                    for source, v in (
                        ("device", m.cached_tokens_device_total),
                        ("host", m.cached_tokens_host_total),
                    ):
                        if v > 0:
                            fam.add_metric(values + [source], float(v))
                    yield fam
                    continue
                v = counters.get(spec.base)
                if v is None:
                    continue
                fam = CounterMetricFamily(name, spec.help, labels=spec.labels)
                fam.add_metric(values, float(v))
                yield fam
            elif spec.type == "histogram":
                h = r.histograms.get(spec.base)
                if h is None:
                    continue
                fam = HistogramMetricFamily(name, spec.help, labels=spec.labels)
                fam.add_metric(values, h.buckets(), h.sum)
                yield fam


# ----------------------------------------------------------------------------------------------
# the replica
# ----------------------------------------------------------------------------------------------


class SimError(Exception):
    """A request SGLang would reject with 400."""


@dataclass(eq=False)
class SimReq:
    rid: str
    prompt_len: int
    output_len: int
    output_text: str
    finish_kind: str  # "length" | "stop"
    submit_time: float  # model seconds
    namespace: str
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    first: FirstToken | None = None
    finished: Finished | None = None
    emitted: int = 0  # output tokens handed to the client so far
    aborted: str | None = None  # abort message

    @property
    def over(self) -> bool:
        return self.finished is not None or self.aborted is not None

    @property
    def cached_tokens(self) -> int:
        if self.finished is not None:
            return self.finished.cached_tokens
        return self.first.cached_tokens if self.first is not None else 0


class SimReplica:
    """One simulated replica: the model, its clock, the driver task and the request API."""

    def __init__(
        self,
        profile: Profile | str = "tiny",
        *,
        time_scale: float = 1.0,
        seed: int = 0,
        served_model_name: str | None = None,
        enable_cache_report: bool = True,
        enable_metrics: bool = True,
        max_running_requests: int | None = None,
        page_size: int | None = None,
        context_length: int | None = None,
        kv_events_config: str | dict[str, Any] | None = None,
        output_len_median: int = 256,
        stream_interval_s: float = STREAM_INTERVAL_S,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(profile, str):
            profile = load_profile(profile)
        update: dict[str, Any] = {}
        if max_running_requests is not None:
            update["max_running_requests"] = max_running_requests
        if page_size is not None:
            update["page_size"] = page_size
        if update:
            profile = Profile.model_validate({**profile.model_dump(), **update})
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.profile = profile
        self.time_scale = float(time_scale)
        self.seed = seed
        self.served_model_name = served_model_name or profile.name
        self.enable_cache_report = enable_cache_report
        self.enable_metrics = enable_metrics
        self.context_len = context_length or DEFAULT_CONTEXT_LEN
        self.output_len_median = max(1, output_len_median)
        self.stream_interval_s = stream_interval_s
        self.host, self.port = host, port
        self._clock = clock
        self._t0 = clock()
        self.kv_events_config = parse_kv_events_config(kv_events_config)
        self.publisher: SimKVPublisher | None = None
        if self.kv_events_config is not None:
            self.publisher = publisher_from_config(
                self.kv_events_config, profile.page_size, self.served_model_name
            )
        self.model = ReplicaModel(profile, kv_sink=self.publisher)
        self._reqs: dict[str, SimReq] = {}
        self._rid_rng = random.Random(seed)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.failed: str | None = None  # set when the driver died on a model error
        self.scheduler_label_values = (self.served_model_name, "unified", "0", "0", "0")
        self.tokenizer_label_values = (self.served_model_name, "unified")
        self.histograms: dict[str, _Hist] = {
            spec.base: _Hist(spec.buckets or ())
            for spec in sg.METRIC_SPECS
            if spec.type == "histogram"
        }
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SimCollector(self))  # type: ignore[arg-type]
        self.created = int(time.time())

    # -- clock ------------------------------------------------------------------------------------
    def now(self) -> float:
        return (self._clock() - self._t0) * self.time_scale

    def wall_delay(self, model_time: float) -> float:
        return max(0.0, (model_time - self.now()) / self.time_scale)

    # -- driver -----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._drive(), name="sim-driver")
        if self.publisher is not None:
            self.publisher.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for st in list(self._reqs.values()):
            st.aborted = st.aborted or "server shutting down"
            st.changed.set()
        if self.publisher is not None:
            await self.publisher.close()

    def wake(self) -> None:
        self._wake.set()

    def poll(self) -> float:
        """Advance the model to now and deliver its events; returns now (model seconds)."""
        now = self.now()
        for ev in self.model.advance(now):
            if isinstance(ev, FirstToken):
                self._on_first(ev)
            elif isinstance(ev, Finished):
                self._on_finished(ev)
        self._publish()
        return now

    def _publish(self) -> None:
        if self.publisher is not None:
            self.publisher.flush()

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            try:
                self.poll()
            except Exception as exc:  # a model bug must not silently stall every request
                log.exception("sim replica: model step failed")
                self.failed = f"simulated replica failed: {exc!r}"
                for st in list(self._reqs.values()):
                    st.aborted = self.failed
                    st.changed.set()
                self._reqs.clear()
                raise
            t = self.model.next_event_time()
            handle = None
            if t is not None:
                handle = loop.call_later(self.wall_delay(t), self._wake.set)
            try:
                await self._wake.wait()
            finally:
                if handle is not None:
                    handle.cancel()

    def _on_first(self, ev: FirstToken) -> None:
        st = self._reqs.get(ev.rid)
        self.histograms[sg.TIME_TO_FIRST_TOKEN_SECONDS].observe(ev.ttft)
        self.histograms[sg.QUEUE_TIME_SECONDS].observe(ev.queue_time)
        if st is not None:
            st.first = ev
            st.changed.set()

    def _on_finished(self, ev: Finished) -> None:
        st = self._reqs.pop(ev.rid, None)
        if st is None:
            return
        self.histograms[sg.E2E_REQUEST_LATENCY_SECONDS].observe(ev.time - st.submit_time)
        if st.first is not None and ev.completion_tokens > 1:
            # observe_inter_token_latency: interval / n tokens into one bucket, n times; the
            # whole interval into _sum.
            interval = ev.time - st.first.time
            n = ev.completion_tokens - 1
            self.histograms[sg.INTER_TOKEN_LATENCY_SECONDS].observe(interval / n, n, interval)
        st.finished = ev
        st.changed.set()

    # -- request API ------------------------------------------------------------------------------
    def new_rid(self) -> str:
        return "%032x" % self._rid_rng.getrandbits(128)

    def namespace(self, body: dict[str, Any]) -> str:
        return request_namespace(self.served_model_name, body)

    def _seed_for(self, rid: str) -> int:
        h = hashlib.blake2b(f"{self.seed}\x1f{rid}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little")

    def choose_output_len(self, rid: str, cap: int, ignore_eos: bool) -> tuple[int, str]:
        cap = max(1, cap)
        if ignore_eos:
            return cap, "length"
        rng = random.Random(self._seed_for(rid))
        draw = max(1, int(round(rng.lognormvariate(math.log(self.output_len_median), 0.75))))
        if draw >= cap:
            return cap, "length"
        return draw, "stop"

    def submit(
        self,
        *,
        prompt_text: str | None = None,
        input_ids: list[int] | None = None,
        max_new_tokens: int | None,
        ignore_eos: bool = False,
        rid: str | None = None,
        namespace: str | None = None,
    ) -> SimReq:
        """Tokenize, choose the output, and hand the request to the model (raises SimError)."""
        if self.failed is not None:
            raise SimError(self.failed)
        if input_ids is not None:
            prompt_len = len(input_ids)
        else:
            prompt_len = tokenizer.count_tokens(prompt_text or "")
        if prompt_len < 1:
            raise SimError("The input is empty.")
        if prompt_len >= self.context_len:
            raise SimError(
                f"The input ({prompt_len} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        if max_new_tokens is not None:
            if max_new_tokens < 0:
                raise SimError("max_new_tokens must be at least 0, got %d." % max_new_tokens)
            if prompt_len + max_new_tokens > self.context_len:
                raise SimError(
                    f"Requested token count exceeds the model's maximum context length of "
                    f"{self.context_len} tokens. You requested a total of "
                    f"{prompt_len + max_new_tokens} tokens: {prompt_len} tokens from the input "
                    f"messages and {max_new_tokens} tokens for the completion. Please reduce "
                    f"the number of tokens in the input messages or the completion to fit "
                    f"within the limit."
                )
            cap = max_new_tokens
        else:
            cap = self.context_len - prompt_len
        rid = rid or self.new_rid()
        if rid in self._reqs:
            raise SimError(f"Duplicate request ID: {rid}")
        out_len, kind = self.choose_output_len(rid, cap, ignore_eos)
        out_text = tokenizer.synthetic_text(out_len, self._seed_for(rid) & 0x7FFFFFFF)
        if input_ids is not None:
            all_tokens = list(input_ids) + tokenizer.encode(out_text)
        else:
            all_tokens = tokenizer.encode((prompt_text or "") + out_text)
        ns = namespace if namespace is not None else self.served_model_name
        keys = page_keys(all_tokens, self.profile.page_size, ns)
        if self.publisher is not None and keys:
            self.publisher.note_root(keys[0], ns)
        now = self.now()
        try:
            self.model.submit(
                SimRequest(rid, prompt_len, out_len, keys, all_tokens), now
            )
        except ValueError as exc:
            raise SimError(str(exc)) from exc
        st = SimReq(rid, prompt_len, out_len, out_text, kind, now, ns)
        self._reqs[rid] = st
        self._publish()
        self.wake()
        return st

    def abort(self, rid: str, message: str = "Abort request.") -> bool:
        st = self._reqs.pop(rid, None)
        if st is None:
            return False
        self.model.abort(rid, self.now())
        st.aborted = message
        st.changed.set()
        self._publish()
        self.wake()
        return True

    def abort_all(self, message: str = "Abort all requests.") -> int:
        return sum(self.abort(rid, message) for rid in list(self._reqs))

    def running_rids(self) -> list[str]:
        return list(self._reqs)

    async def progress(self, st: SimReq) -> AsyncIterator[int]:
        """Cumulative output-token counts as they grow (first value at the first token);
        ends when the request finished or was aborted."""
        last = 0
        while True:
            st.changed.clear()
            if st.finished is not None:
                if st.output_len > last:
                    st.emitted = st.output_len
                    yield st.output_len
                return
            if st.aborted is not None:
                return
            if st.first is not None:
                n = self.model.progress(st.rid, self.now())
                if n > last:
                    last = st.emitted = n
                    yield n
                    continue
                timeout: float | None = self.stream_interval_s
            else:
                timeout = None
            try:
                async with asyncio.timeout(timeout):
                    await st.changed.wait()
            except TimeoutError:
                pass

    async def wait(self, st: SimReq) -> None:
        while not st.over:
            st.changed.clear()
            if st.over:
                break
            await st.changed.wait()

    def release(self, st: SimReq) -> None:
        """Handler exit: a request that did not finish is aborted in the model (client gone)."""
        if not st.over:
            self.abort(st.rid, "The client disconnected.")

    # -- load views -------------------------------------------------------------------------------
    def decode_sum_seq_lens(self, now: float) -> int:
        total = 0
        for st in self._reqs.values():
            if st.first is not None and st.finished is None:
                total += st.prompt_len + self.model.progress(st.rid, now)
        return total

    def waiting_tokens(self) -> int:
        return sum(st.prompt_len for st in self._reqs.values() if st.first is None)

    def spec_accept_rate(self) -> float:
        p = self.profile
        if p.spec_verify_tokens <= 1:
            return 0.0
        return (p.spec_accept_length - 1.0) / (p.spec_verify_tokens - 1)

    def loads_entry(self, sections: set[str]) -> dict[str, Any]:
        self.poll()
        now = self.now()
        load = self.model.load(now)
        p = self.profile
        every = "all" in sections
        entry: dict[str, Any] = {
            "dp_rank": 0,
            "timestamp": time.time(),
            "num_running_reqs": load.num_running_reqs,
            "num_waiting_reqs": load.num_queue_reqs,
            "num_used_tokens": load.num_used_tokens,
            "num_total_tokens": load.num_used_tokens + self.waiting_tokens(),
            "max_total_num_tokens": load.max_total_num_tokens,
            "token_usage": round(load.token_usage, 4),
            "gen_throughput": round(load.gen_throughput, 2),
            "cache_hit_rate": round(load.cache_hit_rate, 4),
            "utilization": round(load.num_running_reqs / p.max_running_requests, 4),
            "max_running_requests": p.max_running_requests,
            "memory": None,
            "speculative": None,
            "lora": None,
            "disaggregation": None,
            "queues": None,
        }
        if every or "memory" in sections:
            entry["memory"] = {
                "weight_gb": round(p.n_total_params * p.weight_bytes_per_param / p.gpus / 1e9, 2),
                "kv_cache_gb": round(p.max_total_num_tokens * p.kv_bytes_per_token / 1e9, 2),
                "graph_gb": 0.0,
                "token_capacity": p.max_total_num_tokens,
            }
        if (every or "spec" in sections) and p.spec_verify_tokens > 1:
            entry["speculative"] = {
                "accept_length": round(load.spec_accept_length, 4),
                "accept_rate": round(self.spec_accept_rate(), 4),
            }
        if every or "queues" in sections:
            entry["queues"] = {
                "waiting": load.num_queue_reqs,
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
            }
        return entry


# ----------------------------------------------------------------------------------------------
# HTTP
# ----------------------------------------------------------------------------------------------

SIM_KEY: web.AppKey[SimReplica] = web.AppKey("sim_replica", SimReplica)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def native_error(message: str, status: int = 400) -> web.Response:
    """SGLang's ``_create_error_response``: ``{"error": {"message": ...}}``."""
    return _json({"error": {"message": message}}, status)


def openai_error(message: str, status: int = 400, type_: str = "Bad Request", param: str | None = None) -> web.Response:
    """SGLang's OpenAI ``ErrorResponse``."""
    return _json(
        {"object": "error", "message": message, "type": type_, "param": param, "code": status},
        status,
    )


async def _read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SimError(f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise SimError("The request body must be a JSON object.")
    return body


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _int_field(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise SimError(f"{name} must be an integer, got {v!r}")
        return v
    return None


class SimHandlers:
    def __init__(self, sim: SimReplica) -> None:
        self.sim = sim

    # ---- shared pieces ----------------------------------------------------------------------
    def _usage(self, st: SimReq, completion_tokens: int | None = None) -> dict[str, Any]:
        ct = st.output_len if completion_tokens is None else completion_tokens
        return {
            "prompt_tokens": st.prompt_len,
            "total_tokens": st.prompt_len + ct,
            "completion_tokens": ct,
            "prompt_tokens_details": (
                {"cached_tokens": st.cached_tokens} if self.sim.enable_cache_report else None
            ),
        }

    @staticmethod
    def _openai_finish(st: SimReq) -> tuple[str, Any]:
        if st.aborted is not None:
            return "abort", None
        if st.finish_kind == "stop":
            return "stop", EOS_TOKEN_ID
        return "length", None

    def _native_finish(self, st: SimReq) -> dict[str, Any] | None:
        if st.aborted is not None:
            return {"type": "abort", "message": st.aborted, "status_code": None, "err_type": None}
        if st.finished is None:
            return None
        if st.finish_kind == "stop":
            return {"type": "stop", "matched": EOS_TOKEN_ID}
        return {"type": "length", "length": st.output_len}

    async def _start_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        return resp

    # ---- /generate --------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        sim = self.sim
        try:
            body = await _read_json(request)
            text, input_ids = body.get("text"), body.get("input_ids")
            if isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)):
                raise SimError("Batch requests are not supported by the simulated replica.")
            if text is None and input_ids is None:
                raise SimError("Either text, input_ids or input_embeds should be provided.")
            if text is not None and not isinstance(text, str):
                raise SimError("text must be a string.")
            if input_ids is not None and not (
                isinstance(input_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids)
            ):
                raise SimError("input_ids must be a list of integers.")
            sp = body.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise SimError("sampling_params must be an object.")
            max_new = _int_field(sp, "max_new_tokens")
            if max_new is None:
                max_new = GENERATE_DEFAULT_MAX_NEW_TOKENS
            rid = body.get("rid")
            if rid is not None and not isinstance(rid, str):
                raise SimError("rid must be a string.")
            st = sim.submit(
                prompt_text=text if input_ids is None else None,
                input_ids=input_ids,
                max_new_tokens=max_new,
                ignore_eos=bool(sp.get("ignore_eos", False)),
                rid=rid,
                namespace=sim.namespace(body),
            )
        except SimError as exc:
            return native_error(str(exc))
        try:
            if body.get("stream"):
                resp = await self._start_stream(request)
                sent_final = False
                async for n in sim.progress(st):
                    sent_final = st.finished is not None and n >= st.output_len
                    await resp.write(_sse(self._generate_obj(st, None if sent_final else n)))
                if not sent_final:
                    await resp.write(_sse(self._generate_obj(st, None)))
                await resp.write(SSE_DONE)
                await resp.write_eof()
                return resp
            await sim.wait(st)
            return _json(self._generate_obj(st, None))
        finally:
            sim.release(st)

    def _generate_obj(self, st: SimReq, n: int | None) -> dict[str, Any]:
        """The /generate object after n output tokens; n=None: final (finished or aborted)."""
        final = n is None
        if final:
            n = st.output_len if st.finished is not None else st.emitted
        text = st.output_text[: 4 * n]
        end = st.finished.time if (final and st.finished is not None) else self.sim.now()
        meta = {
            "id": st.rid,
            "finish_reason": self._native_finish(st) if final else None,
            "prompt_tokens": st.prompt_len,
            "completion_tokens": n,
            "cached_tokens": st.cached_tokens,
            "e2e_latency": end - st.submit_time,
        }
        return {"text": text, "output_ids": tokenizer.encode(text), "meta_info": meta}

    # ---- OpenAI -----------------------------------------------------------------------------
    def _openai_common(self, body: dict[str, Any]) -> tuple[int | None, bool, str | None]:
        n = body.get("n")
        if n not in (None, 1):
            raise SimError("n > 1 is not supported by the simulated replica.")
        max_tokens = _int_field(body, "max_completion_tokens", "max_tokens")
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise SimError("rid must be a string.")
        return max_tokens, bool(body.get("ignore_eos", False)), rid

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        sim = self.sim
        try:
            body = await _read_json(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise SimError("messages must be a non-empty list of message objects.")
            max_tokens, ignore_eos, rid = self._openai_common(body)
            prompt = render_chat(messages, body.get("tools"))
            st = sim.submit(
                prompt_text=prompt,
                max_new_tokens=max_tokens,
                ignore_eos=ignore_eos,
                rid=rid,
                namespace=sim.namespace(body),
            )
        except SimError as exc:
            return openai_error(str(exc))
        model = body.get("model") or sim.served_model_name
        created = int(time.time())
        try:
            if body.get("stream"):
                return await self._chat_stream(request, st, body, model, created)
            await sim.wait(st)
            finish, matched = self._openai_finish(st)
            n = st.output_len if st.finished is not None else st.emitted
            return _json(
                {
                    "id": st.rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {
                                "role": "assistant",
                                "content": st.output_text[: 4 * n],
                                "reasoning_content": None,
                                "tool_calls": None,
                            },
                            "logprobs": None,
                            "finish_reason": finish,
                            "matched_stop": matched,
                        }
                    ],
                    "usage": self._usage(st, n),
                }
            )
        finally:
            sim.release(st)

    async def _chat_stream(
        self, request: web.Request, st: SimReq, body: dict[str, Any], model: str, created: int
    ) -> web.StreamResponse:
        sim = self.sim
        opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))

        def chunk(delta: dict[str, Any], finish: str | None = None, matched: Any = None) -> bytes:
            full = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}
            full.update(delta)
            return _sse(
                {
                    "id": st.rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [
                        {"index": 0, "delta": full, "logprobs": None,
                         "finish_reason": finish, "matched_stop": matched}
                    ],
                    "usage": None,
                }
            )

        resp = await self._start_stream(request)
        last = 0
        first = True
        async for n in sim.progress(st):
            if first:
                await resp.write(chunk({"role": "assistant", "content": ""}))
                first = False
            await resp.write(chunk({"content": st.output_text[4 * last : 4 * n]}))
            last = n
        finish, matched = self._openai_finish(st)
        await resp.write(chunk({}, finish, matched))
        if include_usage:
            usage = {
                "id": st.rid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [], "usage": self._usage(st, last),
            }
            await resp.write(_sse(usage))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        sim = self.sim
        try:
            body = await _read_json(request)
            prompt = body.get("prompt")
            text: str | None = None
            ids: list[int] | None = None
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                text = prompt
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids = prompt
            else:
                raise SimError("prompt must be a string or a list of token ids (one prompt).")
            max_tokens, ignore_eos, rid = self._openai_common(body)
            if max_tokens is None:
                max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
            st = sim.submit(
                prompt_text=text, input_ids=ids, max_new_tokens=max_tokens,
                ignore_eos=ignore_eos, rid=rid, namespace=sim.namespace(body),
            )
        except SimError as exc:
            return openai_error(str(exc))
        model = body.get("model") or sim.served_model_name
        created = int(time.time())

        def obj(text: str, finish: str | None, matched: Any, usage: Any) -> dict[str, Any]:
            return {
                "id": st.rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish, "matched_stop": matched}],
                "usage": usage,
            }

        try:
            if body.get("stream"):
                opts = body.get("stream_options") or {}
                include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
                resp = await self._start_stream(request)
                last = 0
                async for n in sim.progress(st):
                    await resp.write(_sse(obj(st.output_text[4 * last : 4 * n], None, None, None)))
                    last = n
                finish, matched = self._openai_finish(st)
                await resp.write(_sse(obj("", finish, matched, None)))
                if include_usage:
                    u = obj("", None, None, self._usage(st, last))
                    u["choices"] = []
                    await resp.write(_sse(u))
                await resp.write(SSE_DONE)
                await resp.write_eof()
                return resp
            await sim.wait(st)
            finish, matched = self._openai_finish(st)
            n = st.output_len if st.finished is not None else st.emitted
            return _json(obj(st.output_text[: 4 * n], finish, matched, self._usage(st, n)))
        finally:
            sim.release(st)

    # ---- info / control -----------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        sim = self.sim
        return _json(
            {
                "model_path": sim.served_model_name,
                "tokenizer_path": sim.served_model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "kvrouter_sim",
                "architectures": ["KvrouterSimReplica"],
            }
        )

    def _server_args(self) -> dict[str, Any]:
        sim, p = self.sim, self.sim.profile
        return {
            "model_path": sim.served_model_name,
            "tokenizer_path": sim.served_model_name,
            "served_model_name": sim.served_model_name,
            "host": sim.host,
            "port": sim.port,
            "tp_size": p.gpus,
            "dp_size": 1,
            "pp_size": 1,
            "page_size": p.page_size,
            "max_running_requests": p.max_running_requests,
            "chunked_prefill_size": p.chunked_prefill_size,
            "context_length": sim.context_len,
            "max_total_tokens": p.max_total_num_tokens,
            "enable_cache_report": sim.enable_cache_report,
            "enable_metrics": sim.enable_metrics,
            "enable_hierarchical_cache": p.host_total_num_tokens > 0,
            "disable_radix_cache": False,
            "schedule_policy": "fcfs",
            "kv_events_config": (
                orjson.dumps(sim.kv_events_config).decode() if sim.kv_events_config else None
            ),
            # simulator-only knobs
            "sim_profile": p.name,
            "sim_time_scale": sim.time_scale,
            "sim_seed": sim.seed,
        }

    async def server_info(self, request: web.Request) -> web.Response:
        sim, p = self.sim, self.sim.profile
        sim.poll()
        load = sim.model.load(sim.now())
        body = {
            **self._server_args(),
            "max_total_num_tokens": p.max_total_num_tokens,
            "max_req_input_len": sim.context_len - 1,
            "internal_states": [
                {
                    "dp_rank": 0,
                    "last_gen_throughput": load.gen_throughput,
                    "avg_spec_accept_length": load.spec_accept_length,
                    "memory_usage": {"token_capacity": p.max_total_num_tokens},
                }
            ],
            "version": SIM_VERSION,
            "kv_events": sim.publisher.descriptor() if sim.publisher is not None else None,
        }
        return _json(body)

    def _model_card(self) -> dict[str, Any]:
        sim = self.sim
        return {
            "id": sim.served_model_name,
            "object": "model",
            "created": sim.created,
            "owned_by": "sglang",
            "root": sim.served_model_name,
            "max_model_len": sim.context_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        m = request.match_info["model"]
        if m != self.sim.served_model_name:
            return _json(
                {"error": {"message": f"The model '{m}' does not exist",
                           "type": "invalid_request_error", "param": "model",
                           "code": "model_not_found"}},
                404,
            )
        return _json(self._model_card())

    async def loads(self, request: web.Request) -> web.Response:
        include = request.query.get("include", "core")
        sections = {s.strip() for s in include.split(",") if s.strip()} or {"core"}
        bad = sections - set(VALID_LOAD_SECTIONS)
        if bad:
            return _json(
                {"detail": f"Invalid include sections: {sorted(bad)}. Valid: {list(VALID_LOAD_SECTIONS)}"},
                400,
            )
        dp = request.query.get("dp_rank")
        if dp not in (None, "", "0"):
            return _json({"detail": f"dp_rank {dp} out of range"}, 400)
        entry = self.sim.loads_entry(sections)
        if request.query.get("format") == "prometheus":
            return web.Response(text=_loads_prometheus([entry]), content_type="text/plain")
        p = self.sim.profile
        return _json(
            {
                "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                "version": SIM_VERSION,
                "accelerator": None,
                "num_accelerators": p.gpus,
                "loads": [entry],
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        entry = self.sim.loads_entry({"core"})
        waiting = self.sim.waiting_tokens()
        return _json(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": entry["num_running_reqs"] + entry["num_waiting_reqs"],
                    "num_waiting_reqs": entry["num_waiting_reqs"],
                    "num_tokens": entry["num_total_tokens"],
                    "num_pending_tokens": waiting,
                    "ts_tic": time.perf_counter(),
                }
            ]
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        sim = self.sim
        sim.poll()
        ok = sim.model.flush_cache()
        sim._publish()
        if not ok:
            return web.Response(status=400, text="Flush cache failed.\n")
        return web.Response(status=200, text=FLUSH_OK)

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
        except SimError as exc:
            return native_error(str(exc))
        if body.get("abort_all"):
            self.sim.abort_all()
        else:
            rid = body.get("rid")
            if isinstance(rid, str) and rid:
                self.sim.abort(rid)
            elif isinstance(rid, list):
                for r in rid:
                    if isinstance(r, str):
                        self.sim.abort(r)
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        data = generate_latest(self.sim.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _loads_prometheus(entries: list[dict[str, Any]]) -> str:
    """``/v1/loads?format=prometheus``: ``sglang_<field>{dp_rank}``, sections flattened, gauges."""
    series: dict[str, list[tuple[int, float]]] = {}
    sections = {"memory": "memory", "speculative": "spec", "disaggregation": "disagg", "queues": "queues"}
    for e in entries:
        dp = e["dp_rank"]
        for k, v in e.items():
            if k in ("dp_rank", "timestamp"):
                continue
            if isinstance(v, dict):
                prefix = sections.get(k, k)
                for sk, sv in v.items():
                    if isinstance(sv, (int, float)) and not isinstance(sv, bool):
                        series.setdefault(f"sglang_{prefix}_{sk}", []).append((dp, sv))
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                series.setdefault(f"sglang_{k}", []).append((dp, v))
    lines = []
    for name, rows in series.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{dp}"}} {float(v)}' for dp, v in rows)
    return "\n".join(lines) + "\n"


def build_app(
    profile: Profile | str = "tiny",
    time_scale: float = 1.0,
    seed: int = 0,
    *,
    replica: SimReplica | None = None,
    **kwargs: Any,
) -> web.Application:
    """The aiohttp app of one simulated replica; ``app[SIM_KEY]`` is its :class:`SimReplica`.

    Serve it with ``web.AppRunner(app, handler_cancellation=True)`` so that a client that goes
    away aborts its request in the model, as SGLang does.
    """
    sim = replica or SimReplica(profile, time_scale=time_scale, seed=seed, **kwargs)
    h = SimHandlers(sim)
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[SIM_KEY] = sim
    r = app.router
    r.add_post("/generate", h.generate)
    r.add_post("/v1/chat/completions", h.chat_completions)
    r.add_post("/v1/completions", h.completions)
    for path in ("/health", "/health_generate"):
        r.add_get(path, h.health)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, h.model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, h.server_info)
    r.add_get("/v1/models", h.models)
    r.add_get("/v1/models/{model:.+}", h.model_card)
    r.add_get("/v1/loads", h.loads)
    r.add_get("/get_load", h.get_load)
    r.add_route("GET", "/flush_cache", h.flush_cache)
    r.add_route("POST", "/flush_cache", h.flush_cache)
    r.add_post("/abort_request", h.abort_request)
    if sim.enable_metrics:
        r.add_get("/metrics", h.metrics)

    async def _startup(app: web.Application) -> None:
        await sim.start()

    async def _cleanup(app: web.Application) -> None:
        await sim.stop()

    app.on_startup.append(_startup)
    app.on_cleanup.append(_cleanup)
    return app


async def serve(sim: SimReplica, host: str, port: int) -> None:
    app = build_app(replica=sim)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    sim.port = bound
    p = sim.profile
    log.info(
        "sim-replica %s on http://%s:%d profile=%s time_scale=%g kv=%d tokens page=%d%s",
        sim.served_model_name, host, bound, p.name, sim.time_scale, p.max_total_num_tokens,
        p.page_size, f" kv-events={sim.publisher.endpoint}" if sim.publisher else "",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def run(args: Any) -> int:
    """Entry point of ``kvrouter sim-replica`` (args from the CLI parser)."""
    from ..router.serve import install_uvloop

    install_uvloop()

    async def main() -> None:
        sim = SimReplica(
            args.profile,
            time_scale=args.time_scale,
            seed=args.seed,
            served_model_name=args.served_model_name,
            enable_cache_report=args.enable_cache_report,
            enable_metrics=args.enable_metrics,
            max_running_requests=args.max_running_requests,
            page_size=args.page_size,
            context_length=args.context_length,
            kv_events_config=args.kv_events_config,
            host=args.host,
            port=args.port,
        )
        await serve(sim, args.host, args.port)

    asyncio.run(main())
    return 0
