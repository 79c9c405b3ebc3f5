"""The simulated replica's Prometheus exposition (``/metrics``), in SGLang's metric names.

Everything is read from the replica at scrape time; histograms are filled by the replica as its
model reports first tokens and finished requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from ..sglang_protocol import signals as sg

if TYPE_CHECKING:
    from .sim_replica import SimReplica


class Histogram:
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
            out.append((bucket_label(b), acc))
        acc += self.counts[-1]
        out.append(("+Inf", acc))
        return out


def bucket_label(b: float) -> str:
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

