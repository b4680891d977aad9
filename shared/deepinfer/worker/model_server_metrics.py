"""The model-server protocol's gauges (vLLM's names), which the Gateway API Inference Extension's endpoint picker
and KEDA read from a worker's /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from deepinfer.engine import EngineStats

_GAUGES = (
    ("vllm:num_requests_waiting", "Requests waiting for admission (model-server protocol)."),
    ("vllm:num_requests_running", "Requests in the running batch (model-server protocol)."),
    ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use, 1 = full (model-server protocol)."),
    ("vllm:gpu_cache_usage_perc", "Fraction of KV blocks in use, 1 = full (its older name)."),
)


class ModelServerGauges:
    """Set from the engine's stats at every heartbeat."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._gauges = {name: Gauge(name, doc, registry=registry) for name, doc in _GAUGES}

    def set(self, stats: EngineStats) -> None:
        gauges = self._gauges
        usage = 1.0 - stats.num_free_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0
        gauges["vllm:num_requests_waiting"].set(stats.num_waiting)
        gauges["vllm:num_requests_running"].set(stats.num_running)
        gauges["vllm:kv_cache_usage_perc"].set(usage)
        gauges["vllm:gpu_cache_usage_perc"].set(usage)
