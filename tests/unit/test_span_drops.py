"""Spans a batch span processor drops on a full queue: counted for Prometheus, and one warning per interval
instead of one per span (the SDK's own behaviour, which this pins: a change of its message fails here)."""

from __future__ import annotations

import logging
import threading

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry

from deepinfer.config import CommonSettings
from deepinfer.telemetry import setup_tracer_provider
from deepinfer.telemetry.tracing import SPAN_DROPS, SpanDrops, count_dropped_spans


class StalledExporter(SpanExporter):
    """Holds the processor's worker in its first export until released, so the queue fills."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def export(self, spans):
        self.release.wait(10)
        return SpanExportResult.SUCCESS


def test_dropped_spans_are_counted_and_their_warnings_thinned(monkeypatch, caplog):
    SPAN_DROPS.install()
    monkeypatch.setattr(SPAN_DROPS, "_last_warning", float("-inf"))
    registry = CollectorRegistry()
    count_dropped_spans(registry)
    exporter = StalledExporter()
    provider = TracerProvider()
    provider.add_span_processor(
        BatchSpanProcessor(exporter, max_queue_size=4, max_export_batch_size=1, schedule_delay_millis=10)
    )
    tracer = provider.get_tracer("t")
    before = SPAN_DROPS.count
    try:
        with caplog.at_level(logging.WARNING, logger=SpanDrops.SDK_LOGGER):
            for i in range(50):
                tracer.start_span(f"span-{i}").end()
    finally:
        exporter.release.set()
        provider.shutdown()

    dropped = SPAN_DROPS.count - before
    assert 40 <= dropped <= 50  # one span in the stalled export and four queued at most were kept
    assert registry.get_sample_value("deepinfer_trace_spans_dropped_total") == SPAN_DROPS.count
    warnings = [r.getMessage() for r in caplog.records if r.name == SpanDrops.SDK_LOGGER]
    assert len(warnings) == 1 and "span queue full" in warnings[0], warnings


def test_an_exporting_provider_watches_for_drops_and_other_sdk_records_pass(tmp_path):
    logger = logging.getLogger(SpanDrops.SDK_LOGGER)
    saved = list(logger.filters)
    try:
        for f in list(logger.filters):
            logger.removeFilter(f)
        setup_tracer_provider(CommonSettings(otel_exporter="none", data_dir=tmp_path), "t").shutdown()
        assert SPAN_DROPS not in logger.filters  # exporter off: no processor, nothing to watch
        provider = setup_tracer_provider(CommonSettings(otel_exporter="file", data_dir=tmp_path), "t")
        provider.shutdown()
        assert SPAN_DROPS in logger.filters
        other = logging.LogRecord(SpanDrops.SDK_LOGGER, logging.WARNING, __file__, 1, "Exception while exporting",
                                  None, None)
        assert SPAN_DROPS.filter(other) is True
    finally:
        for f in list(logger.filters):
            logger.removeFilter(f)
        for f in saved:
            logger.addFilter(f)
