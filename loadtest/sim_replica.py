"""One simulated SGLang replica behind its HTTP surface: the model, its clock and the request API.

The pure :class:`~kvrouter.loadtest.replica_model.ReplicaModel` decides everything that takes
time (queueing, prefill with prefix-cache hits, decode, eviction); :class:`SimReplica` gives it a
clock and the calls the HTTP handlers make (shapes in ``docs/sglang-fidelity.md``):

* clock: model time = (wall monotonic - start) x ``time_scale``. One driver task sleeps until
  the model's ``next_event_time()`` (in wall time) or until a submit/abort wakes it, calls
  ``advance(now)`` and resolves the waiting requests. Streams poll ``progress(rid, now)`` at
  least every ``stream_interval_s`` of wall time, so tokens arrive over time.
* text: prompts are tokenized with ``loadtest/tokenizer`` at ``chars_per_token`` bytes per token
  (default 4; chat messages rendered first, see ``loadtest/sim_prompt.py``); the output is ``tokenizer.synthetic_text`` of the chosen
  length, and the pages a request leaves in the cache are those of ``prompt + output``, so the
  next turn of a conversation (whose history carries this reply) hits them.
* cache namespaces: served model name + ``extra_key`` / ``cache_salt`` / ``lora_path``.
* signals: ``/metrics`` gauges, ``/v1/loads`` and KV-event batches are what the model last
  *published*, at SGLang's own refresh points (``loadtest/replica_signals.py``), not its state
  at the scrape.
* output length: with ``ignore_eos`` exactly ``max_tokens`` (``max_new_tokens``), else a
  deterministic draw from (seed, rid) capped by it.
* DP attention (``dp_size`` > 1): one model per DP rank (its own radix cache, KV pool,
  scheduler and load; attention on the rank's own GPU: ``profiles.rank_profile``). A request
  goes to ``routed_dp_rank`` when it names one, else to ``bootstrap_room % dp_size`` on a PD
  server (SGLang's ``follow_bootstrap_room``), else round robin. ``/metrics`` and KV events
  show rank 0; ``/v1/loads`` has one entry per rank.

Times reported (``e2e_latency``, the latency histograms) are model seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ..sglang_protocol.block_hash import request_namespace
from . import tokenizer
from .profiles import Profile, load_profile, rank_profile
from .radix_cache import page_keys
from .replica_model import Finished, FirstToken, ReplicaModel, SimRequest
from .replica_signals import PublishedLoads, PublishedMetrics
from .sim_disagg import Disaggregation, RoomBoard, RoomResult
from .sim_kv_publisher import SimKVPublisher, parse_kv_events_config, publisher_from_config
from .sim_metrics_page import MetricsPage
from .sim_tokenizer_metrics import TokenizerMetrics

log = logging.getLogger("kvrouter.sim")

DEFAULT_CONTEXT_LEN = 262144
STREAM_INTERVAL_S = 0.02


class SimError(Exception):
    """A request SGLang would reject (400 unless told otherwise)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


EOS_LENGTH_SIGMA = 0.75  # spread (log space) of a reply's length when it ends at EOS


def eos_length(rng: random.Random, median: int) -> int:
    """Where a reply without ``ignore_eos`` ends: a lognormal draw of ``median`` tokens (before the
    ``max_tokens`` cap). Also the cluster simulator's ``eos_median`` (cluster_config.py)."""
    return max(1, int(round(rng.lognormvariate(math.log(median), EOS_LENGTH_SIGMA))))


@dataclass(eq=False)
class SimReq:
    rid: str
    prompt_len: int
    output_len: int
    output_text: str
    finish_kind: str  # "length" | "stop"
    submit_time: float  # model seconds
    namespace: str
    stream: bool = False  # the tokenizer metrics' is_streaming label
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    first: FirstToken | None = None
    finished: Finished | None = None
    emitted: int = 0  # output tokens handed to the client so far
    aborted: str | None = None  # abort message
    rank: int = 0  # the DP rank serving it
    room: int | None = None  # PD prefill side: the bootstrap room this request serves
    transferred_cached: int | None = None  # PD decode side: the prefill side's cached tokens
    chars_per_token: float = tokenizer.DEFAULT_CHARS_PER_TOKEN

    def output_chars(self, start: int, end: int) -> str:
        """The output text of tokens ``[start, end)``."""
        return self.output_text[int(start * self.chars_per_token) : int(end * self.chars_per_token)]

    @property
    def over(self) -> bool:
        return self.finished is not None or self.aborted is not None

    @property
    def cached_tokens(self) -> int:
        if self.transferred_cached is not None:
            return self.transferred_cached
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
        chars_per_token: float = tokenizer.DEFAULT_CHARS_PER_TOKEN,
        stream_interval_s: float = STREAM_INTERVAL_S,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
        disaggregation: Disaggregation | None = None,
        dp_size: int = 1,
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
        if dp_size < 1:
            raise ValueError("dp_size must be at least 1")
        self.dp_size = dp_size
        self._next_rank = 0  # round robin when nothing names a rank
        self.profile = profile
        self.time_scale = float(time_scale)
        self.seed = seed
        self.served_model_name = served_model_name or profile.name
        self.enable_cache_report = enable_cache_report
        self.enable_metrics = enable_metrics
        self.context_len = context_length or DEFAULT_CONTEXT_LEN
        self.output_len_median = max(1, output_len_median)
        tokenizer.check_chars_per_token(chars_per_token)
        self.chars_per_token = float(chars_per_token)
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
        ranked = rank_profile(profile, dp_size)
        self.models = [ReplicaModel(ranked, kv_sink=self.publisher if i == 0 else None)
                       for i in range(dp_size)]
        self._reqs: dict[str, SimReq] = {}
        self._rid_rng = random.Random(seed)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.failed: str | None = None  # set when the driver died on a model error
        self.disagg = disaggregation or Disaggregation()
        # the prefill side's rooms, answered by its bootstrap server (sim_disagg)
        self.rooms: RoomBoard | None = RoomBoard() if self.disagg.mode == "prefill" else None
        engine_type = self.disagg.mode if self.disagg.enabled else "unified"
        self.scheduler_label_values = (self.served_model_name, engine_type, "0", "0", "0")
        self.tokenizer_label_values = (self.served_model_name, engine_type)
        self.tokenizer_metrics = TokenizerMetrics()
        self.metrics_page = MetricsPage(self)  # what /metrics serves
        self.created = int(time.time())

    @property
    def model(self) -> ReplicaModel:
        """DP rank 0's model (the only one without DP attention)."""
        return self.models[0]

    def choose_rank(self, routed_dp_rank: Any = None, room: int | None = None) -> int:
        """The DP rank of a request (SimError for a ``routed_dp_rank`` out of range)."""
        if routed_dp_rank is not None:
            if (isinstance(routed_dp_rank, bool) or not isinstance(routed_dp_rank, int)
                    or not 0 <= routed_dp_rank < self.dp_size):
                raise SimError(f"routed_dp_rank {routed_dp_rank!r} out of range [0, {self.dp_size})")
            return routed_dp_rank
        if room is not None:
            return room % self.dp_size
        rank = self._next_rank
        self._next_rank = (rank + 1) % self.dp_size
        return rank

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
            self._settle_room(st)
            st.changed.set()
        if self.publisher is not None:
            await self.publisher.close()

    def wake(self) -> None:
        self._wake.set()

    def poll(self) -> float:
        """Advance the model to now and deliver its events; returns now (model seconds)."""
        now = self.now()
        for model in self.models:
            for ev in model.advance(now):
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
                    self._settle_room(st)
                    st.changed.set()
                self._reqs.clear()
                raise
            times = [t for m in self.models if (t := m.next_event_time()) is not None]
            t = min(times) if times else None
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
        self.tokenizer_metrics.first_token(ev, st.stream if st is not None else False)
        if st is not None:
            st.first = ev
            st.changed.set()

    def _on_finished(self, ev: Finished) -> None:
        st = self._reqs.pop(ev.rid, None)
        if st is None:
            return
        self.tokenizer_metrics.finished(ev, st.stream, st.submit_time, st.first)
        st.finished = ev
        self._settle_room(st)
        st.changed.set()

    def _settle_room(self, st: SimReq) -> None:
        """PD prefill side: tell the decode half (via the bootstrap server) how its room ended."""
        if self.rooms is None or st.room is None:
            return
        if st.finished is not None:
            self.rooms.settle(st.room, RoomResult(
                st.prompt_len, st.finished.cached_tokens, dp_rank=st.rank, dp_size=self.dp_size))
        else:
            self.rooms.settle(st.room, RoomResult(st.prompt_len, 0, st.aborted or "aborted"))

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
        draw = eos_length(random.Random(self._seed_for(rid)), self.output_len_median)
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
        stream: bool = False,
        room: int | None = None,
        transferred_cached: int | None = None,
        rank: int = 0,
    ) -> SimReq:
        """Tokenize, choose the output, and hand the request to the model (raises SimError).

        PD: on a prefill server the request generates one token and settles ``room``; a
        request given ``transferred_cached`` (decode server) has its KV already and computes no
        prefill."""
        if self.failed is not None:
            raise SimError(self.failed)
        if input_ids is not None:
            prompt_len = len(input_ids)
        else:
            prompt_len = tokenizer.count_tokens(prompt_text or "", self.chars_per_token)
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
        if self.disagg.mode == "prefill":
            out_len, kind = 1, "length"  # the prefill forward's one token; decode runs elsewhere
        out_text = tokenizer.synthetic_text(out_len, self._seed_for(rid) & 0x7FFFFFFF, self.chars_per_token)
        if input_ids is not None:
            all_tokens = list(input_ids) + tokenizer.encode(out_text, chars_per_token=self.chars_per_token)
        else:
            all_tokens = tokenizer.encode((prompt_text or "") + out_text, chars_per_token=self.chars_per_token)
        ns = namespace if namespace is not None else self.served_model_name
        keys = page_keys(all_tokens, self.profile.page_size, ns)
        if self.publisher is not None and keys:
            self.publisher.note_root(keys[0], ns)
        now = self.now()
        try:
            self.models[rank].submit(
                SimRequest(
                    rid, prompt_len, out_len, keys, all_tokens, max_new_tokens=cap,
                    kv_transferred=transferred_cached is not None,
                ),
                now,
            )
        except ValueError as exc:
            raise SimError(str(exc)) from exc
        st = SimReq(
            rid, prompt_len, out_len, out_text, kind, now, ns, stream,
            rank=rank, room=room, transferred_cached=transferred_cached,
            chars_per_token=self.chars_per_token,
        )
        self._reqs[rid] = st
        self._publish()
        self.wake()
        return st

    def abort(self, rid: str, message: str = "Abort request.") -> bool:
        st = self._reqs.pop(rid, None)
        if st is None:
            return False
        self.models[st.rank].abort(rid, self.now())
        st.aborted = message
        self._settle_room(st)
        st.changed.set()
        self._publish()
        self.wake()
        return True

    def abort_all(self, message: str = "Abort all requests.") -> int:
        return sum(self.abort(rid, message) for rid in list(self._reqs))

    def flush_cache(self) -> bool:
        """SGLang's ``/flush_cache``: refused (False) while requests are running or waiting."""
        self.poll()
        ok = not self._reqs and all([m.flush_cache() for m in self.models])
        self._publish()
        return ok

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
                n = self.models[st.rank].progress(st.rid, self.now())
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
    def published_loads(self, rank: int = 0) -> PublishedLoads:
        """The last published ``/v1/loads`` snapshot of DP rank ``rank`` (SGLang's cadence, not
        the instant state)."""
        self.poll()
        return self.models[rank].published_loads(self.now())

    def published_metrics(self) -> PublishedMetrics:
        """The ``/metrics`` gauges as SGLang last refreshed them."""
        self.poll()
        return self.model.published_metrics(self.now())
