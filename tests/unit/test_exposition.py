"""merge_expositions: several processes' /metrics as one, each series labelled with its process."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.telemetry.exposition import merge_expositions


def exposition(requests: int, ttft_s: float) -> str:
    registry = CollectorRegistry()
    Counter("deepinfer_gateway_requests", "HTTP requests", ["route"], registry=registry).labels("chat").inc(requests)
    Histogram("deepinfer_ttft_seconds", "TTFT", buckets=(0.1, 1.0), registry=registry).observe(ttft_s)
    Gauge("deepinfer_up", "up", registry=registry).set(1)
    return generate_latest(registry).decode()


def test_every_sample_once_with_its_process_label():
    merged = merge_expositions({"0": exposition(1, 0.05), "1": exposition(2, 0.5)}, "gateway_process")
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert families["deepinfer_gateway_requests"].type == "counter"
    assert families["deepinfer_ttft_seconds"].type == "histogram"
    requests = {(s.labels["gateway_process"], s.labels["route"]): s.value
                for s in families["deepinfer_gateway_requests"].samples if s.name.endswith("_total")}
    assert requests == {("0", "chat"): 1.0, ("1", "chat"): 2.0}
    buckets = {(s.labels["gateway_process"], s.labels["le"]): s.value
               for s in families["deepinfer_ttft_seconds"].samples if s.name.endswith("_bucket")}
    assert buckets[("0", "0.1")] == 1.0 and buckets[("1", "0.1")] == 0.0 and buckets[("1", "1.0")] == 1.0
    # one HELP/TYPE per family, and no series twice
    assert merged.count("# TYPE deepinfer_gateway_requests_total counter") == 1
    series = [line.rsplit(" ", 1)[0] for line in merged.splitlines() if line and not line.startswith("#")]
    assert len(series) == len(set(series))


def test_the_parent_label_wins_and_an_empty_input_merges_to_nothing():
    text = 'deepinfer_up{gateway_process="x"} 1.0\n'
    merged = merge_expositions({"3": text}, "gateway_process")
    assert 'deepinfer_up{gateway_process="3"} 1.0' in merged
    assert merge_expositions({}, "gateway_process") == ""


def test_a_broken_exposition_is_an_error():
    with pytest.raises(ValueError):
        merge_expositions({"0": "this is { not metrics"}, "gateway_process")
