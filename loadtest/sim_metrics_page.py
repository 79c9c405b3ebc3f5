"""The simulated replica's ``/metrics`` page, cheap to scrape.

Routers poll ``/metrics`` several times a second, and the simulated replica answers on the event
loop that also runs its model: every millisecond a scrape costs delays the model's view of
arriving requests (``time_scale`` times over in model time). Real SGLang serves ``/metrics`` from
the tokenizer-manager process, off the scheduler's loop, so a scrape there costs the engine
nothing. prometheus_client's ``generate_latest`` formats and escapes every one of the ~200
samples (mostly histogram buckets) on every scrape; :class:`MetricsPage` writes the same bytes
(:class:`~kvrouter.loadtest.sim_metrics.SimCollector` through ``generate_latest``) with the
constant parts formatted once: each family's HELP and TYPE lines and each label set, and a
histogram's lines only again after it was observed. The page bytes are reused while no exposed
value changed (an idle replica's page).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.utils import floatToGoString

from ..sglang_protocol import metric_names as sg
from .sim_metrics import Histogram, bucket_label, exposed_series

if TYPE_CHECKING:
    from .sim_replica import SimReplica


def _escape_label_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def label_text(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    """``{name="value",...}`` sorted by label name, as prometheus_client writes a sample's labels."""
    pairs = sorted(zip(names, values))
    return "{" + ",".join(f'{k}="{_escape_label_value(v)}"' for k, v in pairs) + "}"


def family_header(spec: sg.MetricSpec) -> str:
    """The HELP and TYPE lines of a family (a counter's family name keeps its ``_total``)."""
    doc = spec.help.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {spec.name()} {doc}\n# TYPE {spec.name()} {spec.type}\n"


class _HistogramLines:
    """One histogram series' lines, reformatted only when the histogram was observed."""

    __slots__ = ("histogram", "prefixes", "count_prefix", "sum_prefix", "with_sum", "version", "text")

    def __init__(self, spec: sg.MetricSpec, values: tuple[str, ...], h: Histogram) -> None:
        self.histogram = h
        name = spec.name()
        les = [bucket_label(b) for b in h.bounds] + ["+Inf"]
        self.prefixes = [f"{name}_bucket{label_text(spec.labels + ('le',), values + (le,))} " for le in les]
        plain = label_text(spec.labels, values)
        self.count_prefix = f"{name}_count{plain} "
        self.sum_prefix = f"{name}_sum{plain} "
        # prometheus_client leaves out _count and _sum when the first bucket is negative
        self.with_sum = float(les[0]) >= 0
        self.version = -1
        self.text = ""

    def render(self, h: Histogram) -> str:
        if h.version != self.version:
            lines = []
            acc = 0.0
            for prefix, c in zip(self.prefixes, h.counts):
                acc += c
                lines.append(f"{prefix}{floatToGoString(acc)}\n")
            if self.with_sum:
                lines.append(f"{self.count_prefix}{floatToGoString(acc)}\n")
                lines.append(f"{self.sum_prefix}{floatToGoString(h.sum)}\n")
            self.text = "".join(lines)
            self.version = h.version
        return self.text


class MetricsPage:
    """The ``/metrics`` page of one replica: :func:`render` gives prometheus_client's text of
    :func:`~kvrouter.loadtest.sim_metrics.exposed_series` at this moment."""

    def __init__(self, replica: SimReplica) -> None:
        self.r = replica
        self._headers = {spec.base: family_header(spec) for spec in sg.METRIC_SPECS}
        self._sample_prefixes: dict[tuple[str, tuple[str, ...]], str] = {}
        self._histograms: dict[tuple[str, tuple[str, ...]], _HistogramLines] = {}
        self._parts: list[str] = []
        self._page = b""

    def _sample_prefix(self, spec: sg.MetricSpec, values: tuple[str, ...]) -> str:
        key = (spec.base, values)
        prefix = self._sample_prefixes.get(key)
        if prefix is None:
            prefix = self._sample_prefixes[key] = f"{spec.name()}{label_text(spec.labels, values)} "
        return prefix

    def _histogram(self, spec: sg.MetricSpec, values: tuple[str, ...], h: Histogram) -> str:
        key = (spec.base, values)
        lines = self._histograms.get(key)
        if lines is None or lines.histogram is not h:
            lines = self._histograms[key] = _HistogramLines(spec, values, h)
        return lines.render(h)

    def render(self) -> bytes:
        parts: list[str] = []
        for spec, samples in exposed_series(self.r):
            parts.append(self._headers[spec.base])
            for values, v in samples:
                if isinstance(v, Histogram):
                    parts.append(self._histogram(spec, values, v))
                else:
                    parts.append(f"{self._sample_prefix(spec, values)}{floatToGoString(v)}\n")
        if parts != self._parts:  # unchanged parts are the same strings: compared by identity
            self._parts = parts
            self._page = "".join(parts).encode("utf-8")
        return self._page
