"""OpenTelemetry traces: one tracer provider per service, W3C traceparent carried in NATS headers.

With `otel_exporter=none` (the default) the provider's tracers are OpenTelemetry's no-op tracers: a hop makes no
span object and attaches no context (`deepinfer.telemetry.hops`), and a publish adds a `traceparent` only when a
valid span context is current (`deepinfer.bus.envelope`). So a non-exporting service starts no trace of its own,
while a trace that reaches it (a caller's `traceparent` on a message) passes through it unchanged to what it calls.

An exporting service samples as the standard `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` say (unset:
`parentbased_always_on`, every trace). Parent-based samplers follow the caller's decision (the sampled flag of the
`traceparent`), so with `parentbased_traceidratio` on every service the gateway, where each trace starts, decides
once per request and a request it leaves out is recorded nowhere. Code that would open a span per token checks
`span.is_recording()` first; which of a traced request's token batches and SSE writes become spans is
`otel_token_spans` (`Hops.token_spans`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import NoOpTracer, NoOpTracerProvider, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from deepinfer.config import CommonSettings
from deepinfer.telemetry.trace_file import JsonLinesSpanExporter

#: `otel_token_spans`: which per-token events of a traced request become spans.
TokenSpanSelection = Literal["first_last", "all"]


class TelemetryError(RuntimeError):
    """Telemetry was configured in a way this installation cannot honour."""


class UnexportedTracerProvider(NoOpTracerProvider):
    """The provider of `otel_exporter=none`: its tracers are no-op tracers, and there is nothing to flush."""

    def shutdown(self) -> None:
        """Nothing was recorded."""


class ServiceTracerProvider(TracerProvider):
    """An SDK provider whose tracers carry `token_spans` (`otel_token_spans`), which `Hops` reads: the services
    build their Hops from a tracer alone. The sampler is the SDK's from the environment unless one is given."""

    def __init__(self, token_spans: TokenSpanSelection = "first_last", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.token_spans = token_spans

    def get_tracer(self, *args: Any, **kwargs: Any) -> Tracer:
        """The SDK's tracer, tagged with `token_spans`."""
        tracer = super().get_tracer(*args, **kwargs)
        tracer.token_spans = self.token_spans  # type: ignore[attr-defined]
        return tracer


class SpanDrops(logging.Filter):
    """Counts the spans the SDK's batch span processors drop on a full queue, and thins the SDK's warnings.

    The SDK (1.45) drops a span when the processor's queue is full and says so only in a WARNING per span from
    its `opentelemetry.sdk._shared_internal` logger, which its DuplicateFilter thins to one per 20 s: no count
    anyone can read. This filter, first on that logger, counts every one and lets one warning through per
    `interval_s`, with the count so far; `count_dropped_spans` exposes the count as a Prometheus counter."""

    SDK_LOGGER = "opentelemetry.sdk._shared_internal"
    MESSAGE = "Queue full, dropping"

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.count = 0
        self._lock = threading.Lock()
        self._last_warning = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        """Count a drop record; pass it (reworded) once per interval, and every other record unchanged."""
        if not str(record.msg).startswith(self.MESSAGE):
            return True
        with self._lock:
            self.count += 1
            now = time.monotonic()
            show = now - self._last_warning >= self.interval_s
            if show:
                self._last_warning = now
            count = self.count
        if show:
            record.msg = ("span queue full: spans are being dropped (%d so far in this process; "
                          "deepinfer_trace_spans_dropped_total; raise OTEL_BSP_MAX_QUEUE_SIZE)")
            record.args = (count,)
        return show

    def install(self) -> None:
        """Watch the SDK's logger (once per process), ahead of its own filters: the SDK's DuplicateFilter passes
        one identical record per 20 s, and a filter after it would never see the rest."""
        logger = logging.getLogger(self.SDK_LOGGER)
        if self not in logger.filters:
            logger.filters.insert(0, self)


#: The process's span-drop count (every batch span processor of the process logs through the same logger).
SPAN_DROPS = SpanDrops()


class _SpanDropCollector(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("deepinfer_trace_spans_dropped", "Spans a batch span processor dropped because "
                                  "its queue was full (OTEL_BSP_MAX_QUEUE_SIZE)", value=SPAN_DROPS.count)


def count_dropped_spans(registry: CollectorRegistry) -> None:
    """Expose `deepinfer_trace_spans_dropped_total` (this process's dropped spans) on `registry`."""
    registry.register(_SpanDropCollector())


def setup_tracer_provider(
    common: CommonSettings, service_name: str
) -> ServiceTracerProvider | UnexportedTracerProvider:
    """A provider exporting as `common.otel_exporter` says, sampling as OTEL_TRACES_SAMPLER says; call
    `shutdown()` on it when the service stops."""
    if common.otel_exporter == "none":
        return UnexportedTracerProvider()
    SPAN_DROPS.install()
    resource = Resource.create({"service.name": f"deepinfer-{service_name}"})
    provider = ServiceTracerProvider(common.otel_token_spans, resource=resource)
    if common.otel_exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))
    elif common.otel_exporter == "otlp":
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(common.otel_endpoint)))
    elif common.otel_exporter == "file":
        directory = common.otel_file_dir or common.data_dir / "traces"
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(directory, service_name)))
    return provider


def setup_tracing(common: CommonSettings, service_name: str) -> Tracer:
    """A tracer for `service_name`; exporter none (spans dropped) unless configured."""
    return setup_tracer_provider(common, service_name).get_tracer(f"deepinfer.{service_name}")


def records_spans(tracer: Tracer) -> bool:
    """Whether `tracer` can record a span: False for a no-op tracer (exporter none) or one that samples nothing."""
    return not isinstance(tracer, NoOpTracer) and getattr(tracer, "sampler", None) is not ALWAYS_OFF


def token_spans_of(tracer: Tracer) -> TokenSpanSelection:
    """The `otel_token_spans` a `ServiceTracerProvider` gave `tracer`; first_last for any other tracer."""
    return getattr(tracer, "token_spans", "first_last")


def _otlp_exporter(endpoint: str | None) -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TelemetryError(
                "otel_exporter=otlp needs the opentelemetry-exporter-otlp package "
                "(pip install opentelemetry-exporter-otlp), or set DEEPINFER_OTEL_EXPORTER=none|console"
            ) from exc
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


def inject_trace_headers(headers: dict[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
    """Add W3C `traceparent` (and `tracestate`) of the current span to NATS message headers."""
    carrier = dict(headers or {})
    TraceContextTextMapPropagator().inject(carrier, context=context)
    return carrier


def extract_trace_context(headers: Mapping[str, str] | None) -> Context:
    """The remote span context from received NATS headers (an empty context without them)."""
    return TraceContextTextMapPropagator().extract(dict(headers or {}))
