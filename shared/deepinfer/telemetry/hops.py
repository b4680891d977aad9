"""The hops of a request inside one service: a span each (in the request's trace) and the histogram
`deepinfer_<service>_hop_seconds{hop}`, from one call.

    hops = Hops(tracer, registry, "gateway")
    with hops.span("route"):                       # span "gateway.route", current while the block runs
        ...
    hops.record("queue", added_s, scheduled_s)     # a hop measured afterwards, from time.monotonic() readings

The histogram always counts, so a hop's cost is visible in /metrics without tracing. Spans follow the tracer:
with the exporter none (a no-op tracer, `records_spans` false) a hop is its histogram observation and nothing
else: no span object, no context attached, so a caller's trace context stays current through it (and a publish
inside carries it on).

Per-token hops (a decode token batch, a gateway SSE write) happen once per step per request: with tracing on
their histogram observes every one (`observe`), and of a traced request (`span.is_recording()`) only those its
`TokenSpans` picks become spans (`record_span`): the first and the last by default, every one with
`otel_token_spans=all`. With the exporter none they cost nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, NoOpTracer, Span, Tracer, use_span
from prometheus_client import CollectorRegistry, Histogram

from deepinfer.telemetry.metrics import histogram
from deepinfer.telemetry.tracing import records_spans, token_spans_of

#: Hop latencies: 50 µs .. 60 s (a bus round trip is ~0.5 ms, a prefill up to seconds); dense between 1 and 35 ms,
#: where the serving hops live (with 1 / 2.5 ms bounds only, every hop of 1-2.5 ms read as p50 1.75 ms).
HOP_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015,
    0.02, 0.025, 0.035, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
)


def epoch_offset_ns() -> int:
    """time.time_ns() - time.monotonic_ns(), the monotonic clock read first. Shifted by it, a monotonic reading
    lands no earlier than a time.time_ns() taken before the reading, and (the reading taken before this call) no
    later than one taken after this call: a recorded span sits between the SDK-stamped spans (time.time_ns()) of
    its task that precede and follow it. Read per span, not once per process: an offset read once is off by
    whatever passed between its two reads (a preemption: milliseconds on a busy machine) or by a later clock
    step: a gateway's first SSE write was once stamped 8 ms before the decode admission that precedes it in the
    same task, and before its root."""
    monotonic_ns = time.monotonic_ns()
    return time.time_ns() - monotonic_ns


def epoch_ns(monotonic_s: float, offset_ns: int | None = None) -> int:
    """A time.monotonic() reading as Unix nanoseconds (what span timestamps are), shifted by `offset_ns` (read
    now when not given)."""
    return (epoch_offset_ns() if offset_ns is None else offset_ns) + int(monotonic_s * 1e9)


class Hops:
    """One service's hop spans and hop histogram; see the module docstring."""

    def __init__(self, tracer: Tracer | None, registry: CollectorRegistry, service: str) -> None:
        self.tracer = tracer or NoOpTracer()
        #: False with the exporter none: hops then make no spans (INVALID_SPAN stands in where one is asked for).
        self.recording = records_spans(self.tracer)
        #: `otel_token_spans` is all: every token batch / SSE write of a traced request is a span.
        self.every_token_span = token_spans_of(self.tracer) == "all"
        self.service = service
        self.seconds = histogram(
            registry, f"{service}_hop_seconds", f"Time per hop of a request inside the {service}.", ["hop"],
            buckets=HOP_BUCKETS_S,
        )
        self._by_hop: dict[str, Histogram] = {}  # labels() takes a lock and checks its arguments each call

    def span(self, hop: str, **attributes: Any) -> AbstractContextManager[Span]:
        """Time the block as `hop`: a current span `<service>.<hop>` and one histogram observation (only the
        observation, and INVALID_SPAN as the span, when not recording)."""
        if not self.recording:
            return _Timed(self._histogram(hop))
        return self._recorded(hop, attributes)

    @contextmanager
    def _recorded(self, hop: str, attributes: dict[str, Any]) -> Iterator[Span]:
        started_s = time.monotonic()
        with self.tracer.start_as_current_span(f"{self.service}.{hop}", attributes=attributes or None) as span:
            try:
                yield span
            finally:
                self._histogram(hop).observe(time.monotonic() - started_s)

    def _histogram(self, hop: str) -> Histogram:
        child = self._by_hop.get(hop)
        if child is None:
            child = self._by_hop[hop] = self.seconds.labels(hop)
        return child

    def current(self, span: Span) -> AbstractContextManager[Span]:
        """`span` (a root started with `self.tracer`) current while the block runs; with no recording, nothing
        is attached (the span is a no-op tracer's)."""
        return use_span(span, end_on_exit=False) if self.recording else nullcontext(span)

    def record(
        self, hop: str, start_s: float, end_s: float, context: Context | None = None, **attributes: Any
    ) -> None:
        """A hop already measured (monotonic seconds): the histogram, and a span under `context` (else the
        current one)."""
        self._histogram(hop).observe(max(0.0, end_s - start_s))
        if self.recording:
            self.record_span(hop, start_s, end_s, context, **attributes)

    def observe(self, hop: str, seconds: float, count: int = 1) -> None:
        """`count` histogram observations of `seconds` for `hop`, no span (a per-token hop left out of the trace)."""
        histogram = self._histogram(hop)
        for _ in range(count):
            histogram.observe(seconds)

    def record_span(
        self, hop: str, start_s: float, end_s: float, context: Context | None = None, **attributes: Any
    ) -> None:
        """Only the span of a hop already measured (its histogram observed apart, see `observe`); both ends shifted
        by one offset read now, so the span sits between the SDK-stamped spans that caused it and those after."""
        offset_ns = epoch_offset_ns()
        span = self.tracer.start_span(
            f"{self.service}.{hop}", context=context, start_time=epoch_ns(start_s, offset_ns),
            attributes=attributes or None,
        )
        span.end(end_time=epoch_ns(end_s, offset_ns))

    def token_spans(self, context: Context) -> TokenSpans:
        """The selection of one traced request's per-token spans, under `context` (its parent)."""
        return TokenSpans(context, self.every_token_span)


class TokenSpans:
    """Which of one traced request's per-token events (token batches, SSE writes) become spans: the first (the
    one that carries the first token: TTFT) and the last (it ends the stream), or every one."""

    __slots__ = ("context", "every", "num_events")

    def __init__(self, context: Context, every: bool = False) -> None:
        self.context = context
        self.every = every
        self.num_events = 0

    def wanted(self, last: bool) -> bool:
        """Count one event; whether it becomes a span (`last`: the request's final one)."""
        self.num_events += 1
        return self.every or last or self.num_events == 1


class _Timed:
    """A hop's block when nothing records spans: one histogram observation of its duration."""

    __slots__ = ("_histogram", "_started_s")

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._started_s = 0.0

    def __enter__(self) -> Span:
        self._started_s = time.monotonic()
        return INVALID_SPAN

    def __exit__(self, *exc_info: object) -> None:
        self._histogram.observe(time.monotonic() - self._started_s)
