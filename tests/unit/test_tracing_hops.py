"""Hop spans and histograms: the file exporter writes whole spans a reader can parse; with the default exporter
(none) nothing is recorded, nothing is written, and per-token spans are never created."""

from __future__ import annotations

import time
from pathlib import Path

from opentelemetry import trace

from deepinfer.config import CommonSettings
from deepinfer.telemetry import new_registry, setup_tracer_provider
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
    assert queue["end_ns"] - queue["start_ns"] == epoch_ns(started_s + 0.002) - epoch_ns(started_s)
    # and the histogram counts both hops
    assert registry.get_sample_value("deepinfer_prefill_hop_seconds_count", {"hop": "queue"}) == 1
    assert registry.get_sample_value("deepinfer_prefill_hop_seconds_count", {"hop": "request"}) == 1


def test_default_exporter_records_nothing_but_still_propagates(tmp_path: Path):
    common = CommonSettings(data_dir=tmp_path)
    assert common.otel_exporter == "none"
    provider = setup_tracer_provider(common, "gateway")
    hops = Hops(provider.get_tracer("t"), new_registry(False), "gateway")
    with hops.span("route") as span:
        assert not span.is_recording()  # callers skip per-token spans on this
        assert span.get_span_context().is_valid  # a traceparent still goes out: an exporting peer can join
        assert trace.get_current_span() is span
    provider.shutdown()
    assert not (tmp_path / "traces").exists() and list(tmp_path.iterdir()) == []


def test_a_span_costs_microseconds_when_not_recorded():
    hops = Hops(setup_tracer_provider(CommonSettings(), "gateway").get_tracer("t"), new_registry(False), "gateway")
    started = time.perf_counter()
    for _ in range(2000):
        with hops.span("route"):
            pass
    per_span_us = (time.perf_counter() - started) / 2000 * 1e6
    assert per_span_us < 200, per_span_us  # a request has about ten: far below a bus round trip (~500 µs)
