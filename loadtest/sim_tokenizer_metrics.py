"""The simulated replica's tokenizer metrics: SGLang's latency histograms and token counters.

SGLang's tokenizer manager counts as requests go (its first token, its end), per
``is_streaming`` value where SGLang labels them so; a label set appears once a request has
touched it, as with prometheus_client. :class:`TokenizerMetrics` is fed the model's events by
``sim_replica.SimReplica`` and read by ``sim_metrics.exposed_series`` at scrape time.
"""

from __future__ import annotations

from ..sglang_protocol import metric_names as sg
from .replica_model import Finished, FirstToken
from .sim_metrics import Histogram


class TokenizerMetrics:
    def __init__(self) -> None:
        # Histograms without an is_streaming label, by base name (every one, from the start).
        self.histograms: dict[str, Histogram] = {
            spec.base: Histogram(spec.buckets or ())
            for spec in sg.METRIC_SPECS
            if spec.type == "histogram" and sg.IS_STREAMING not in spec.labels
        }
        # Those with one, by (base name, streamed), once observed.
        self.stream_histograms: dict[tuple[str, bool], Histogram] = {}
        self.stream_counters: dict[tuple[str, bool], float] = {}

    def _stream_histogram(self, base: str, stream: bool) -> Histogram:
        h = self.stream_histograms.get((base, stream))
        if h is None:
            h = self.stream_histograms[(base, stream)] = Histogram(sg.SPEC_BY_BASE[base].buckets or ())
        return h

    def _count(self, base: str, stream: bool, value: float) -> None:
        self.stream_counters[(base, stream)] = self.stream_counters.get((base, stream), 0.0) + value

    def first_token(self, ev: FirstToken, stream: bool) -> None:
        self._stream_histogram(sg.TIME_TO_FIRST_TOKEN_SECONDS, stream).observe(ev.ttft)
        self.histograms[sg.QUEUE_TIME_SECONDS].observe(ev.queue_time)

    def finished(self, ev: Finished, stream: bool, submit_time: float, first: FirstToken | None) -> None:
        """A request ended (`submit_time` in model seconds; `first`: its first token, if any)."""
        self._stream_histogram(sg.E2E_REQUEST_LATENCY_SECONDS, stream).observe(ev.time - submit_time)
        self._count(sg.PROMPT_TOKENS_TOTAL, stream, ev.prompt_tokens)
        self._count(sg.GENERATION_TOKENS_TOTAL, stream, ev.completion_tokens)
        self._count(sg.NUM_REQUESTS_TOTAL, stream, 1)
        if first is not None and ev.completion_tokens > 1:
            # observe_inter_token_latency: interval / n tokens into one bucket, n times; the
            # whole interval into _sum.
            interval = ev.time - first.time
            n = ev.completion_tokens - 1
            self.histograms[sg.INTER_TOKEN_LATENCY_SECONDS].observe(interval / n, n, interval)
