"""What an SGLang replica publishes, and when: the ``/metrics`` gauges, the ``/v1/loads`` snapshot
and the KV-event batches, each refreshed only at SGLang's own points (docs/sglang-fidelity.md,
"Signal cadence").

SGLang never answers a scrape from its live state:

* ``/metrics`` gauges are set by ``SchedulerMetricsCollector.log_stats``, called after each
  prefill batch (``report_prefill_stats``), every ``decode_log_interval`` decode iterations
  (``report_decode_stats``) and, while fully idle, at most every 30 s (``_maybe_log_idle_metrics``).
  ``cache_hit_rate`` is the last prefill batch's and is reset to 0 at every decode report.
  ``new_token_ratio`` (the prefill batch's admission ratio) and ``num_retracted_reqs`` (the last
  retraction's count, then zeroed) are set only by the prefill report (``log_prefill_stats``);
  the other reports repeat them.
* ``/v1/loads`` reads a load snapshot written by ``publish_load_snapshot``: forced on every
  prefill batch result and on idle, else every ``load_snapshot_publish_interval`` decode results.
  Its throughput, hit rate and utilization come from the metrics stats above.
* KV events are flushed (``publish_kv_events``) at the end of both stats reports and on idle.

:class:`SignalState` holds the published values and the counters behind the cadence; the replica
model calls it at those points with the state SGLang would read there. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .profiles import Profile


@dataclass(slots=True, frozen=True)
class PoolState:
    """The scheduler's view at one instant (what SGLang's pool stats and queues read)."""

    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int
    kv_available_tokens: int
    kv_evictable_tokens: int
    host_used_tokens: int
    waiting_seq_tokens: int  # sum of the waiting requests' sequence lengths
    waiting_uncached_tokens: int  # the part of those still to prefill
    decode_sum_seq_lens: int = 0


@dataclass(slots=True, frozen=True)
class PublishedMetrics:
    """The scheduler gauges of ``/metrics`` as of their last refresh at ``time``."""

    time: float
    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int
    token_usage: float
    kv_available_tokens: int
    kv_evictable_tokens: int
    host_used_tokens: int
    cache_hit_rate: float
    gen_throughput: float
    decode_sum_seq_lens: int
    spec_accept_length: float
    spec_accept_rate: float
    utilization: float
    new_token_ratio: float = 0.0  # SchedulerStats' default until the first prefill report
    num_retracted_reqs: int = 0


@dataclass(slots=True, frozen=True)
class RetractionState:
    """What the scheduler holds about retraction when it reports a prefill batch."""

    retractions_total: int  # requests retracted so far
    last_retraction: int  # requests retracted by the latest retraction
    new_token_ratio: float  # the admission ratio now


@dataclass(slots=True, frozen=True)
class PublishedLoads:
    """The ``/v1/loads`` snapshot as of its last publish at ``time`` (rounded as SGLang does)."""

    time: float
    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_uncached_tokens: int
    num_used_tokens: int
    num_total_tokens: int
    token_usage: float
    gen_throughput: float
    cache_hit_rate: float
    utilization: float
    spec_accept_length: float | None  # lifetime mean; None before the first decode report
    spec_accept_rate: float


class DeferredKVSink:
    """Holds the radix cache's KV events until the replica's next flush point, then hands them
    to the real sink in order (SGLang queues them in the tree and publishes at report points)."""

    __slots__ = ("sink", "_calls")

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self._calls: list[tuple[Callable[..., None], tuple]] = []

    def stored(self, pages: list[tuple[int, int | None, Sequence[int] | None]], medium: str) -> None:
        self._calls.append((self.sink.stored, (pages, medium)))

    def removed(self, keys: list[int], medium: str) -> None:
        self._calls.append((self.sink.removed, (keys, medium)))

    def cleared(self) -> None:
        self._calls.append((self.sink.cleared, ()))

    def release(self) -> None:
        calls, self._calls = self._calls, []
        for fn, args in calls:
            fn(*args)


class SignalState:
    """Published metrics and loads of one replica, and the counters of SGLang's cadence."""

    def __init__(self, profile: Profile, initial: PoolState, kv: DeferredKVSink | None,
                 *, publish_loads: bool = True) -> None:
        """`publish_loads=False`: keep no ``/v1/loads`` snapshot (`loads` stays None), for a
        driver that only reads ``/metrics``; building it at every publish point costs time, and
        nothing else published depends on it."""
        self.profile = profile
        self.kv = kv
        self.publish_loads = publish_loads
        self.spec_on = profile.spec_verify_tokens > 1
        self.forward_ct_decode = 0  # decode iterations, never reset (report_decode_stats modulo)
        self.loads_counter = 0  # decode results since the last load-snapshot publish
        self.decode_reports = 0
        self.last_log_time = 0.0  # last log_stats call (the idle refresh waits 30 s from it)
        self.last_decode_report = 0.0
        self.decode_tokens_at_report = 0
        self.idle_since: float | None = 0.0
        self._stats_throughput = 0.0
        # the scheduler's retraction state, read at prefill reports (bound by the replica model)
        self.retraction_state: Callable[[], RetractionState] | None = None
        self._retractions_reported = 0
        self.metrics = self._metrics(0.0, initial, 0.0, 0.0)
        self.loads: PublishedLoads | None = self._loads(0.0, initial) if publish_loads else None

    # -- values -----------------------------------------------------------------------------------
    def _usage(self, used: int) -> float:
        return used / self.profile.max_total_num_tokens

    def _utilization(self, running: int, token_usage: float) -> float:
        # _calculate_utilization: only with a max_running_requests_under_SLO, else the default 0.
        slo = self.profile.max_running_requests_under_slo
        if not slo:
            return 0.0
        return max(running / slo, token_usage / 0.9)

    def _spec_rate(self) -> float:
        p = self.profile
        return (p.spec_accept_length - 1.0) / (p.spec_verify_tokens - 1) if self.spec_on else 0.0

    def _metrics(self, t: float, s: PoolState, hit_rate: float, throughput: float,
                 decode_sum: int | None = None, spec: bool = False,
                 retraction: tuple[float, int] | None = None) -> PublishedMetrics:
        usage = self._usage(s.num_used_tokens)
        prev = getattr(self, "metrics", None)
        if spec:
            spec_len, spec_rate = self.profile.spec_accept_length, self._spec_rate()
        elif prev is not None:
            spec_len, spec_rate = prev.spec_accept_length, prev.spec_accept_rate
        else:
            spec_len, spec_rate = 0.0, 0.0
        if decode_sum is None:
            decode_sum = prev.decode_sum_seq_lens if prev is not None else 0
        if retraction is None:  # only the prefill report sets them; the stats object keeps them
            retraction = (prev.new_token_ratio, prev.num_retracted_reqs) if prev is not None else (0.0, 0)
        return PublishedMetrics(
            time=t,
            num_running_reqs=s.num_running_reqs,
            num_queue_reqs=s.num_queue_reqs,
            num_used_tokens=s.num_used_tokens,
            token_usage=usage,
            kv_available_tokens=s.kv_available_tokens,
            kv_evictable_tokens=s.kv_evictable_tokens,
            host_used_tokens=s.host_used_tokens,
            cache_hit_rate=hit_rate,
            gen_throughput=throughput,
            decode_sum_seq_lens=decode_sum,
            spec_accept_length=spec_len,
            spec_accept_rate=spec_rate,
            utilization=self._utilization(s.num_running_reqs, usage),
            new_token_ratio=retraction[0],
            num_retracted_reqs=retraction[1],
        )

    def _loads(self, t: float, s: PoolState) -> PublishedLoads:
        m = self.metrics
        spec_len = self.profile.spec_accept_length if self.spec_on and self.decode_reports else None
        return PublishedLoads(
            time=t,
            num_running_reqs=s.num_running_reqs,
            num_waiting_reqs=s.num_queue_reqs,
            num_waiting_uncached_tokens=s.waiting_uncached_tokens,
            num_used_tokens=s.num_used_tokens,
            num_total_tokens=s.num_used_tokens + s.waiting_seq_tokens,
            token_usage=round(self._usage(s.num_used_tokens), 4),
            gen_throughput=round(m.gen_throughput, 2),
            cache_hit_rate=round(m.cache_hit_rate, 4),
            utilization=round(m.utilization, 4),
            spec_accept_length=spec_len,
            spec_accept_rate=m.spec_accept_rate,
        )

    def _log(self, t: float, metrics: PublishedMetrics) -> None:
        self.metrics = metrics
        self.last_log_time = t

    def _flush_kv(self) -> None:
        if self.kv is not None:
            self.kv.release()

    # -- SGLang's points --------------------------------------------------------------------------
    def prefill_result(self, t: float, before: Callable[[], PoolState]) -> None:
        """process_batch_result on a prefill batch: the forced load-snapshot publish, before the
        result is processed (the batch's requests are then neither waiting nor running).
        `before()` gives that state; it is only read when loads are published."""
        self.idle_since = None
        if self.publish_loads:
            self.loads = self._loads(t, before())
        self.loads_counter = 0

    def prefill_report(self, t: float, after: PoolState, hit_rate: float) -> None:
        """report_prefill_stats: the batch's hit rate, queues and pools; throughput unchanged;
        the admission ratio, and the last retraction's count if one happened since the last
        prefill report (the scheduler zeroes its count once logged)."""
        self._log(t, self._metrics(t, after, hit_rate, self._stats_throughput,
                                   retraction=self._take_retraction()))
        self._flush_kv()

    def _take_retraction(self) -> tuple[float, int] | None:
        if self.retraction_state is None:
            return None
        r = self.retraction_state()
        retracted = r.last_retraction if r.retractions_total != self._retractions_reported else 0
        self._retractions_reported = r.retractions_total
        return r.new_token_ratio, retracted

    def decode_points(self, t0: float, dt: float, first: int, last: int,
                      state_at: Callable[[int], tuple[PoolState, int]]) -> None:
        """Decode results `first`..`last` (1-based steps) of a segment that started at t0 with
        step time dt, given the counters as of step first-1. `state_at(j)` is the scheduler state
        after step j and the decode tokens generated since the model started."""
        self.idle_since = None
        n = last - first + 1
        interval = self.profile.decode_log_interval
        every = self.profile.load_snapshot_publish_interval
        # d = steps into this call: a report at every d with (forward_ct_decode + d) % interval
        # == 0; a load publish when the counter reaches `every` (then it restarts from 0).
        report_d = interval - self.forward_ct_decode % interval
        publish_d = max(1, every - self.loads_counter) if self.publish_loads else n + 1
        while min(report_d, publish_d) <= n:
            d = min(report_d, publish_d)
            j = first + d - 1
            t = t0 + j * dt
            state, tokens = state_at(j)
            if publish_d == d:  # publish_load_snapshot runs before the result is processed
                self.loads = self._loads(t, state)
                self.loads_counter = -d  # 0 after this step
                publish_d += every
            if report_d == d:
                gap = t - self.last_decode_report
                self._stats_throughput = (tokens - self.decode_tokens_at_report) / gap if gap > 0 else 0.0
                self.last_decode_report = t
                self.decode_tokens_at_report = tokens
                self.decode_reports += 1
                self._log(t, self._metrics(t, state, 0.0, self._stats_throughput,
                                           state.decode_sum_seq_lens, spec=self.spec_on))
                self._flush_kv()
                report_d += interval
        self.forward_ct_decode += n
        self.loads_counter += n

    def idle(self, t: float, state: PoolState) -> None:
        """The scheduler became fully idle at t: on_idle publishes loads and KV events at once;
        the metrics refresh waits for settle_idle."""
        if self.idle_since is None:
            self.idle_since = t
        if self.publish_loads:
            self.loads = self._loads(t, state)
        self.loads_counter = 0
        self._flush_kv()

    def idle_refresh_at(self) -> float | None:
        """When _maybe_log_idle_metrics next refreshes the gauges (None: not idle). It fires once
        30 s have passed since the last log_stats; as the state cannot change while idle, one
        refresh stands for all later ones."""
        if self.idle_since is None:
            return None
        at = max(self.last_log_time + self.profile.idle_metrics_interval_s, self.idle_since)
        return None if self.metrics.time >= at else at

    def settle_idle(self, now: float, state: Callable[[], PoolState]) -> None:
        """Apply the idle refresh if it is due by `now`; `state` gives the (idle) pools."""
        at = self.idle_refresh_at()
        if at is None or at > now:
            return
        self._stats_throughput = 0.0
        self._log(at, self._metrics(at, state(), self.metrics.cache_hit_rate, 0.0))
