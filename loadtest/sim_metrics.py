"""The simulated replica's Prometheus exposition (``/metrics``), in SGLang's metric names.

Scheduler gauges are the replica's *published* values (refreshed at SGLang's points, see
``loadtest/replica_signals.py``); counters and histograms are read at scrape time, as SGLang's
tokenizer and radix-cache collectors count as they go.

:func:`exposed_series` is the one table of what is exposed. ``/metrics`` serves it through
``sim_metrics_page.MetricsPage`` (cheap to scrape); :class:`SimCollector` gives the same series
as prometheus_client families, whose ``generate_latest`` text the page matches byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Union

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from ..sglang_protocol import metric_names as sg

if TYPE_CHECKING:
    from .sim_replica import SimReplica


class Histogram:
    """A histogram we fill ourselves (so an observation can carry a weight, as SGLang's ITL does).

    `version` counts observations, so a renderer can tell a histogram that did not change."""

    __slots__ = ("bounds", "counts", "sum", "version")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0.0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.version = 0

    def observe(self, value: float, weight: float = 1.0, total: float | None = None) -> None:
        i = 0
        for i, b in enumerate(self.bounds):  # noqa: B007
            if value <= b:
                break
        else:
            i = len(self.bounds)
        self.counts[i] += weight
        self.sum += value * weight if total is None else total
        self.version += 1

    def buckets(self) -> list[tuple[str, float]]:
        out = []
        acc = 0.0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append((bucket_label(b), acc))
        acc += self.counts[-1]
        out.append(("+Inf", acc))
        return out


def bucket_label(b: float) -> str:
    return str(float(b))


#: One exposed series: its label values and its value (a Histogram for a histogram metric).
Sample = tuple[tuple[str, ...], Union[float, Histogram]]


def exposed_series(r: SimReplica) -> Iterator[tuple[sg.MetricSpec, list[Sample]]]:  # noqa: C901 - one flat table
    """Every exposed metric family in ``METRIC_SPECS`` order with its series. A gauge without a
    value (HiCache gauges without HiCache) is not exposed; a labelled counter or histogram is,
    with the label sets touched so far (none yet: its HELP and TYPE only), as prometheus_client
    shows them."""
    m = r.published_metrics()  # SGLang's gauges change only at its refresh points
    p = r.profile
    sched = tuple(r.scheduler_label_values)
    tok = tuple(r.tokenizer_label_values)
    hicache = p.host_total_num_tokens > 0
    model = r.model
    tm = r.tokenizer_metrics
    gauges: dict[str, float | None] = {
        sg.NUM_RUNNING_REQS: m.num_running_reqs,
        sg.NUM_QUEUE_REQS: m.num_queue_reqs,
        sg.NUM_GRAMMAR_QUEUE_REQS: 0,
        sg.GEN_THROUGHPUT: m.gen_throughput,
        sg.CACHE_HIT_RATE: m.cache_hit_rate,
        sg.DECODE_SUM_SEQ_LENS: m.decode_sum_seq_lens,
        sg.TOKEN_USAGE: m.token_usage,
        sg.FULL_TOKEN_USAGE: m.token_usage,
        sg.NUM_USED_TOKENS: m.num_used_tokens,
        sg.KV_AVAILABLE_TOKENS: m.kv_available_tokens,
        sg.KV_EVICTABLE_TOKENS: m.kv_evictable_tokens,
        sg.KV_USED_TOKENS: m.num_used_tokens,
        # log_stats sets both on every refresh; 0 without speculative decoding
        sg.SPEC_ACCEPT_LENGTH: m.spec_accept_length,
        sg.SPEC_ACCEPT_RATE: m.spec_accept_rate,
        sg.UTILIZATION: m.utilization,
        # set by the prefill report only (log_prefill_stats), repeated by the others
        sg.NUM_RETRACTED_REQS: m.num_retracted_reqs,
        sg.NEW_TOKEN_RATIO: m.new_token_ratio,
        sg.MAX_TOTAL_NUM_TOKENS: p.max_total_num_tokens,
        sg.PAGE_SIZE: p.page_size,
        sg.NUM_PAGES: p.max_total_num_tokens // p.page_size,
        sg.CONTEXT_LEN: r.context_len,
        sg.HICACHE_HOST_USED_TOKENS: m.host_used_tokens if hicache else None,
        sg.HICACHE_HOST_TOTAL_TOKENS: p.host_total_num_tokens if hicache else None,
    }
    cache_type = sg.HICACHE_CACHE_TYPE if hicache else sg.RADIX_CACHE_TYPE
    # RadixCacheMetricsCollector: labelled by the cache class only; a series appears with its
    # first increment, as prometheus_client shows only touched label sets.
    radix: dict[str, list[tuple[tuple[str, ...], float]]] = {
        sg.EVICTED_TOKENS_TOTAL: [((cache_type,), model.evicted_tokens_total)],
        sg.LOAD_BACK_TOKENS_TOTAL: (
            [((cache_type, "kv"), model.load_back_tokens_total)] if hicache else []
        ),
    }
    counters: dict[str, float] = {
        sg.NUM_ABORTED_REQUESTS_TOTAL: model.num_aborted_requests_total,
        # increment_retracted_reqs, at each retraction: the series appears with the first
        sg.NUM_RETRACTED_REQUESTS_TOTAL: model.num_retracted_reqs_total,
        sg.NUM_RETRACTED_INPUT_TOKENS_TOTAL: model.num_retracted_input_tokens_total,
        sg.NUM_RETRACTED_OUTPUT_TOKENS_TOTAL: model.num_retracted_output_tokens_total,
    }
    for spec in sg.METRIC_SPECS:
        values = sched if spec.labels[: len(sg.SCHEDULER_LABELS)] == sg.SCHEDULER_LABELS else tok
        by_stream = sg.IS_STREAMING in spec.labels
        samples: list[Sample] = []
        if spec.type == "gauge":
            v = gauges.get(spec.base)
            if v is None:
                continue
            samples.append((values, float(v)))
        elif spec.type == "counter":
            if spec.base in radix:
                samples.extend((labels, float(v)) for labels, v in radix[spec.base] if v > 0)
            elif spec.base == sg.CACHED_TOKENS_TOTAL:
                # SGLang increments nothing for a source with zero cached tokens.
                for source, v in (
                    ("device", model.cached_tokens_device_total),
                    ("host", model.cached_tokens_host_total),
                ):
                    if v > 0:
                        samples.append((values + (source,), float(v)))
            elif by_stream:
                for stream in (False, True):
                    c = tm.stream_counters.get((spec.base, stream))
                    if c is not None:
                        samples.append((values + (sg.streaming_label(stream),), float(c)))
            elif counters.get(spec.base, 0) > 0:
                samples.append((values, float(counters[spec.base])))
        elif spec.type == "histogram":
            if by_stream:
                for stream in (False, True):
                    h = tm.stream_histograms.get((spec.base, stream))
                    if h is not None:
                        samples.append((values + (sg.streaming_label(stream),), h))
            else:
                samples.append((values, tm.histograms[spec.base]))
        yield spec, samples


class SimCollector:
    """prometheus_client collector of :func:`exposed_series`: the replica's exposition as
    prometheus_client writes it, the reference ``MetricsPage`` is held to."""

    def __init__(self, replica: SimReplica) -> None:
        self.r = replica

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        for spec, samples in exposed_series(self.r):
            name = spec.name()
            if spec.type == "histogram":
                hist = HistogramMetricFamily(name, spec.help, labels=spec.labels)
                for values, h in samples:
                    assert isinstance(h, Histogram)
                    hist.add_metric(list(values), h.buckets(), h.sum)
                yield hist
                continue
            family = GaugeMetricFamily if spec.type == "gauge" else CounterMetricFamily
            fam = family(name, spec.help, labels=spec.labels)
            for values, v in samples:
                fam.add_metric(list(values), v)
            yield fam
