"""The hops of a request inside one service: a span each (in the request's trace) and the histogram
`deepinfer_<service>_hop_seconds{hop}`, from one call.

    hops = Hops(tracer, registry, "gateway")
    with hops.span("route"):                       # span "gateway.route", current while the block runs
        ...
    hops.record("queue", added_s, scheduled_s)     # a hop measured afterwards, from time.monotonic() readings

Spans follow the tracer (non-recording when the exporter is none); the histogram always counts, so a hop's
cost is visible in /metrics without tracing. Per-token work (a span per token batch or SSE write) belongs
behind `span.is_recording()`: it has no histogram.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import NoOpTracer, Span, Tracer
from prometheus_client import CollectorRegistry

from deepinfer.telemetry.metrics import histogram

#: Hop latencies: 50 µs .. 60 s (a bus round trip is ~0.5 ms, a prefill up to seconds).
HOP_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 60.0,
)

#: time.time_ns() - time.monotonic_ns(), read once: turns monotonic readings into span timestamps.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as Unix nanoseconds (what span timestamps are)."""
    return _EPOCH_OFFSET_NS + int(monotonic_s * 1e9)


class Hops:
    """One service's hop spans and hop histogram; see the module docstring."""

    def __init__(self, tracer: Tracer | None, registry: CollectorRegistry, service: str) -> None:
        self.tracer = tracer or NoOpTracer()
        self.service = service
        self.seconds = histogram(
            registry, f"{service}_hop_seconds", f"Time per hop of a request inside the {service}.", ["hop"],
            buckets=HOP_BUCKETS_S,
        )

    @contextmanager
    def span(self, hop: str, **attributes: Any) -> Iterator[Span]:
        """Time the block as `hop`: a current span `<service>.<hop>` and one histogram observation."""
        started_s = time.monotonic()
        with self.tracer.start_as_current_span(f"{self.service}.{hop}", attributes=attributes or None) as span:
            try:
                yield span
            finally:
                self.seconds.labels(hop).observe(time.monotonic() - started_s)

    def record(
        self, hop: str, start_s: float, end_s: float, context: Context | None = None, **attributes: Any
    ) -> None:
        """A hop already measured (monotonic seconds): the histogram, and a span under `context` (else the
        current one)."""
        self.seconds.labels(hop).observe(max(0.0, end_s - start_s))
        span = self.tracer.start_span(
            f"{self.service}.{hop}", context=context, start_time=epoch_ns(start_s), attributes=attributes or None
        )
        span.end(end_time=epoch_ns(end_s))
