"""A labelled Prometheus counter whose increments are plain float additions.

`prometheus_client.Counter.inc()` validates its argument, checks the metric is observable and
takes a lock on every call: about a microsecond, where a shadow policy counts three series on
every routing decision. `PlainCounter` keeps each series' value in a dict and builds the
Prometheus family only when the registry is collected (a scrape). For series updated from one
thread (the router's event loop), as the shadow metrics are.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class PlainCounter(Collector):
    def __init__(self, name: str, documentation: str, labelnames: list[str],
                 registry: CollectorRegistry) -> None:
        self.name = name.removesuffix("_total")
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def add(self, labelvalues: tuple[str, ...], amount: float = 1.0) -> None:
        """Count `amount` (not negative) on the series `labelvalues` (in `labelnames` order)."""
        values = self._values
        values[labelvalues] = values.get(labelvalues, 0.0) + amount

    def value(self, *labelvalues: str) -> float | None:
        return self._values.get(labelvalues)

    def forget(self, label: str, value: str) -> None:
        """Drop every series whose `label` is `value` (a replica that left the fleet)."""
        at = self.labelnames.index(label)
        for key in [k for k in self._values if k[at] == value]:
            del self._values[key]

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labelvalues, total in list(self._values.items()):
            family.add_metric(labelvalues, total)
        yield family
