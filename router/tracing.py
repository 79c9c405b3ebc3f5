"""OpenTelemetry tracing (optional: `pip install 'kvrouter[otel]'`).

Per request, a server span (continuing the client's W3C `traceparent` if it sent one) with two
kinds of children per attempt: `kvrouter.route` (the routing decision: policy, reason, replica,
candidates, predicted cached tokens and TTFT) and `kvrouter.upstream` (the exchange with the
replica, first byte to last). The upstream span's context goes to the replica as `traceparent`,
so an SGLang replica exporting its own spans joins the same trace. On a prefill/decode fleet an
attempt is a pair: two upstream spans (`kvrouter.pd_role` prefill and decode, with the
bootstrap room), each server getting its own span's context. Spans are exported over
OTLP/HTTP by the SDK's batch processor, on its own thread.

Off (no endpoint configured, `OTEL_EXPORTER_OTLP_ENDPOINT` unset, or `OTEL_SDK_DISABLED=true`),
nothing here is imported and the relay's only cost is one `is None` check per request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from .decision_log import short_hash

if TYPE_CHECKING:
    from .config import ObservabilityConfig
    from .placement import Placement
    from .usage import UsageReport

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but the `otel` extra is not installed."""


def wanted(config: ObservabilityConfig, environ: Mapping[str, str] = os.environ) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(config.otel_endpoint) or any(environ.get(v) for v in _ENDPOINT_VARS)


class Tracing:
    """The tracer provider and its OTLP exporter; `begin` starts one request's trace."""

    def __init__(self, config: ObservabilityConfig) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as err:
            raise TracingUnavailable(
                f"tracing needs the otel extra (pip install 'kvrouter[otel]'): {err}") from None
        # A configured endpoint is a base URL, as OTEL_EXPORTER_OTLP_ENDPOINT is; without one the
        # exporter reads the standard variables itself (endpoint, headers, timeout...).
        endpoint = config.otel_endpoint
        exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces") if endpoint else OTLPSpanExporter()
        self.provider = TracerProvider(resource=Resource.create({"service.name": config.otel_service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kvrouter")
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, method: str, route: str, headers: Mapping[str, str], request_id: str) -> RequestTrace:
        return RequestTrace(self, method, route, headers, request_id)

    def flush(self) -> None:
        """Export what is buffered (blocking: call it off the event loop)."""
        self.provider.force_flush()

    def shutdown(self) -> None:
        """Flush and stop the exporter (blocking: call it off the event loop)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans."""

    __slots__ = ("tracing", "root", "context", "upstream")

    def __init__(self, tracing: Tracing, method: str, route: str, headers: Mapping[str, str],
                 request_id: str) -> None:
        from opentelemetry import trace

        self.tracing = tracing
        parent = tracing.propagator.extract(headers)  # the client's trace, if it sent one
        self.root = tracing.tracer.start_span(
            f"{method} {route}", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": route, "kvrouter.request_id": request_id})
        self.context = trace.set_span_in_context(self.root)
        self.upstream: Exchange | None = None

    def decided(self, placement: Placement, start_ns: int) -> None:
        """The decision that gave `placement` (taken from `start_ns` until now)."""
        summary, notes = placement.summary, placement.notes
        attrs: dict[str, Any] = {
            "kvrouter.replica": placement.url, "kvrouter.reason": placement.decision.reason,
            "kvrouter.attempt": len(placement.tried) + 1, "kvrouter.prompt_tokens": summary.prompt_tokens,
            "kvrouter.prefix_blocks": len(summary.prefix_blocks),
        }
        if summary.session_key is not None:
            attrs["kvrouter.session"] = short_hash(summary.session_key)
        if notes is not None:
            attrs["kvrouter.policy"] = notes.policy
            attrs["kvrouter.candidates"] = notes.candidates
            attrs["kvrouter.predicted_cached_tokens"] = notes.chosen.cached_tokens
            if notes.chosen.ttft_s is not None:
                attrs["kvrouter.predicted_ttft_s"] = notes.chosen.ttft_s
            for name, decision, _ in notes.shadows:
                attrs[f"kvrouter.shadow.{name}"] = decision.replica if decision is not None else ""
        span = self.tracing.tracer.start_span("kvrouter.route", context=self.context,
                                              start_time=start_ns, attributes=attrs)
        span.end()

    def upstream_start(self, placement: Placement, headers: MutableMapping[str, str]) -> None:
        """The exchange with `placement`'s replica starts: its span's context goes into `headers`."""
        self.upstream = self.exchange(placement.url, len(placement.tried) + 1, headers)

    def upstream_end(self, placement: Placement, status: int | None) -> None:
        exchange, self.upstream = self.upstream, None
        if exchange is not None:
            exchange.end(status, placement.ttfb_s, placement.usage, placement.error)

    def exchange(self, url: str, attempt: int, headers: MutableMapping[str, str],
                 **attributes: str | int) -> Exchange:
        """A `kvrouter.upstream` span for one exchange with the server at `url`, started now; its
        context replaces any `traceparent` in `headers` (the ones sent to that server).
        `attributes` are added as `kvrouter.<name>`."""
        from opentelemetry import trace

        attrs: dict[str, Any] = {"server.address": url, "kvrouter.attempt": attempt}
        attrs.update((f"kvrouter.{name}", value) for name, value in attributes.items())
        span = self.tracing.tracer.start_span("kvrouter.upstream", context=self.context,
                                              kind=trace.SpanKind.CLIENT, attributes=attrs)
        headers.pop("traceparent", None)
        headers.pop("tracestate", None)
        self.tracing.propagator.inject(headers, context=trace.set_span_in_context(span))
        return Exchange(span)

    def end(self, status: int) -> None:
        self.root.set_attribute("http.response.status_code", status)
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            self.root.set_status(Status(StatusCode.ERROR))
        self.root.end()


class Exchange:
    """One exchange's span, ended once: `end` again does nothing (a PD prefill half ends when its
    answer is drained, or with the request, whichever comes first)."""

    __slots__ = ("span",)

    def __init__(self, span: Any) -> None:
        self.span = span

    def end(self, status: int | None, ttfb_s: float | None = None,
            usage: UsageReport | str | None = None, error: str | None = None) -> None:
        """`status`: the server's answer (None: none came); `error`: why the exchange failed."""
        span, self.span = self.span, None
        if span is None:
            return
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if ttfb_s is not None:
            span.set_attribute("kvrouter.ttfb_s", ttfb_s)
        if usage is not None and not isinstance(usage, str) and usage.cached_tokens is not None:
            span.set_attribute("kvrouter.reported_cached_tokens", usage.cached_tokens)
        if error is not None or status is None or status >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error or f"status {status}"))
            if error is not None:
                span.set_attribute("error.type", error)
        span.end()
