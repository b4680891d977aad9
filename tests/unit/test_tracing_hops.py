"""Hop spans and histograms: the file exporter writes whole spans a reader can parse; with the default exporter
(none) a hop is its histogram observation only: no span object, no context attached, nothing injected on a
publish unless a caller's trace is current (which then passes through unchanged), nothing written."""

from __future__ import annotations

import time
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import INVALID_SPAN

from deepinfer.bus.envelope import TRACEPARENT, outgoing_headers
from deepinfer.config import CommonSettings
from deepinfer.telemetry import new_registry, setup_tracer_provider, setup_tracing
from deepinfer.telemetry.hops import Hops, epoch_ns
from deepinfer.telemetry.trace_file import read_spans


def test_file_exporter_writes_parented_spans_a_reader_parses(tmp_path: Path):
    provider = setup_tracer_provider(CommonSettings(otel_exporter="file", otel_file_dir=tmp_path), "prefill")
    registry = new_registry(False)
    hops = Hops(provider.get_tracer("t"), registry, "prefill")
    with hops.span("request", request_id="r1") as root:
        started_s = time.monotonic()
        hops.record("queue", started_s, started_s + 0.002)
    provider.shutdown()  # flushes the batch processor
    spans = {s["name"]: s for s in read_spans(tmp_path)}
    assert set(spans) == {"prefill.request", "prefill.queue"}
    request, queue = spans["prefill.request"], spans["prefill.queue"]
    assert request["attributes"] == {"request_id": "r1"} and request["parent_id"] is None
    assert queue["parent_id"] == request["span_id"] == f"{root.get_span_context().span_id:016x}"
    assert queue["trace_id"] == request["trace_id"] and queue["service"] == "prefill"
    assert queue["end_ns"] - queue["start_ns"] == epoch_ns(started_s + 0.002, 0) - epoch_ns(started_s, 0)
    # and the histogram counts both hops
    assert registry.get_sample_value("deepinfer_prefill_hop_seconds_count", {"hop": "queue"}) == 1
    assert registry.get_sample_value("deepinfer_prefill_hop_seconds_count", {"hop": "request"}) == 1


def test_a_recorded_hop_lies_between_the_spans_of_its_task_before_and_after_it(tmp_path: Path, monkeypatch):
    # The SDK stamps spans with time.time_ns(); a recorded hop converts time.monotonic() readings. Their offset
    # moving by 5 ms after the first span (a clock step; or, for an offset read once per process, a preemption
    # between its two reads) must not put the hop outside the spans that cause it and follow it.
    provider = setup_tracer_provider(CommonSettings(otel_exporter="file", otel_file_dir=tmp_path), "gateway")
    hops = Hops(provider.get_tracer("t"), new_registry(False), "gateway")
    with hops.span("request"):
        with hops.span("decode_admission"):
            pass
        monotonic, monotonic_ns = time.monotonic, time.monotonic_ns
        monkeypatch.setattr(time, "monotonic", lambda: monotonic() + 0.005)
        monkeypatch.setattr(time, "monotonic_ns", lambda: monotonic_ns() + 5_000_000)
        started_s = time.monotonic()
        hops.record("sse_write", started_s, time.monotonic())
        with hops.span("after"):
            pass
    provider.shutdown()
    spans = {s["name"]: s for s in read_spans(tmp_path)}
    request, write = spans["gateway.request"], spans["gateway.sse_write"]
    assert spans["gateway.decode_admission"]["end_ns"] <= write["start_ns"] <= write["end_ns"]
    assert write["end_ns"] <= spans["gateway.after"]["start_ns"] <= request["end_ns"]


def test_default_exporter_records_nothing_and_a_hop_creates_no_span(tmp_path: Path):
    common = CommonSettings(data_dir=tmp_path)
    assert common.otel_exporter == "none"
    provider = setup_tracer_provider(common, "gateway")
    registry = new_registry(False)
    hops = Hops(provider.get_tracer("t"), registry, "gateway")
    assert not hops.recording
    before = otel_context.get_current()
    with hops.span("route", worker_id="w") as span:
        assert span is INVALID_SPAN and not span.is_recording()  # no span object: callers skip per-token spans
        assert otel_context.get_current() is before  # nothing attached
        assert outgoing_headers(None) is None  # no trace context, so a publish injects none
    hops.record("queue", 1.0, 1.5)
    root = provider.get_tracer("t").start_span("gateway.request")
    assert root is INVALID_SPAN
    with hops.current(root):
        assert otel_context.get_current() is before
    provider.shutdown()
    assert not (tmp_path / "traces").exists() and list(tmp_path.iterdir()) == []
    # the histogram still counts every hop
    assert registry.get_sample_value("deepinfer_gateway_hop_seconds_count", {"hop": "route"}) == 1
    assert registry.get_sample_value("deepinfer_gateway_hop_seconds_sum", {"hop": "queue"}) == 0.5


def test_with_the_exporter_off_a_callers_trace_passes_through_a_hop_unchanged():
    caller = TracerProvider().get_tracer("caller")  # an exporting service upstream
    hops = Hops(setup_tracing(CommonSettings(), "decode"), new_registry(False), "decode")
    with caller.start_as_current_span("gateway.decode_admission") as sent:
        headers = outgoing_headers(None)
    assert headers is not None and f"{sent.get_span_context().span_id:016x}" in headers[TRACEPARENT]
    token = otel_context.attach(propagate.extract(headers))  # what the bus does for a received message
    try:
        with hops.span("admission"):
            assert outgoing_headers({"x": "1"}) == {"x": "1", **headers}  # the caller's traceparent, as it came
    finally:
        otel_context.detach(token)


def test_an_exporting_service_still_records_and_propagates_its_hops(tmp_path: Path):
    provider = setup_tracer_provider(CommonSettings(otel_exporter="file", otel_file_dir=tmp_path), "gateway")
    hops = Hops(provider.get_tracer("t"), new_registry(False), "gateway")
    assert hops.recording
    with hops.span("route") as span:
        assert span.is_recording() and trace.get_current_span() is span
        headers = outgoing_headers(None)
    assert headers is not None and f"{span.get_span_context().span_id:016x}" in headers[TRACEPARENT]
    provider.shutdown()


def test_a_hop_costs_its_histogram_observation_and_little_more_when_not_recorded():
    hops = Hops(setup_tracer_provider(CommonSettings(), "gateway").get_tracer("t"), new_registry(False), "gateway")
    child = hops.seconds.labels("route")

    def run_us(block) -> float:  # one short run of 500 (a fraction of a time slice)
        started = time.perf_counter()
        for _ in range(500):
            block()
        return (time.perf_counter() - started) / 500 * 1e6

    def hop() -> None:
        with hops.span("route"):
            pass

    # the best of 20 runs each, the two interleaved: on a busy machine some runs of either are preempted, never
    # all of one while none of the other (as when one's 5 runs fell in a busy spell and the other's did not)
    runs = [(run_us(lambda: child.observe(0.001)), run_us(hop)) for _ in range(20)]
    observe_us, hop_us = min(run[0] for run in runs), min(run[1] for run in runs)
    # ~1.3 µs against ~0.8 on a 2-core CI box; a non-recording OpenTelemetry span per hop made it ~10
    assert hop_us < observe_us + 4, (hop_us, observe_us)
