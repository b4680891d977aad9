"""A speculating worker's /metrics: vLLM's spec_decode counters, added from the engine's running totals."""

from __future__ import annotations

from prometheus_client import generate_latest

from deepinfer.engine.spec_decode_stats import SpecDecodeStats
from deepinfer.telemetry import new_registry
from deepinfer.worker.spec_decode_metrics import SpecDecodeMetrics


def test_counters_follow_the_engine_totals_under_vllm_names():
    registry = new_registry()
    metrics = SpecDecodeMetrics(registry)
    stats = SpecDecodeStats()
    stats.observe(4, 2)
    metrics.update(stats)
    stats.observe(3, 3)
    stats.observe(4, 0)
    metrics.update(stats)
    metrics.update(stats)  # nothing new: nothing added
    text = generate_latest(registry).decode()
    for line in ('vllm:spec_decode_num_drafts_total 3.0', 'vllm:spec_decode_num_draft_tokens_total 11.0',
                 'vllm:spec_decode_num_accepted_tokens_total 5.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 2.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 0.0'):
        assert line in text, line
