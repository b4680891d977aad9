"""Prometheus metrics of a worker's measured KV costs (deepinfer.kv_rates): the rates its load-or-recompute
choices and its heartbeat use, read when scraped, and the prompt tokens those choices loaded or recomputed by tier,
brought up to date at every heartbeat (`update`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from deepinfer.kv_costs import HOST, STORE
from deepinfer.kv_rates import MeasuredRates
from deepinfer.telemetry import counter, gauge

#: (tier, decision) pairs the counter carries, each present from the start.
DECISIONS = [(tier, outcome) for tier in (HOST, STORE) for outcome in ("loaded", "recomputed")]


class KvCostMetrics:
    """`worker_prefill_tokens_per_second`, `worker_kv_load_bytes_per_second{path}` and
    `worker_kv_load_decision_tokens_total{tier, decision}` on a worker's registry."""

    def __init__(self, registry: CollectorRegistry, rates: MeasuredRates) -> None:
        self.rates = rates
        gauge(registry, "worker_prefill_tokens_per_second",
              "Prompt tokens per second the engine computes, as measured (the prior before any prompt step)."
              ).set_function(lambda: rates.prefill.rate)
        loads = gauge(registry, "worker_kv_load_bytes_per_second",
                      "Bytes per second of a KV load by path (host, store, store_shm), as measured (the prior "
                      "before any load).", ["path"])
        for path, throughput in rates.loads.items():
            loads.labels(path).set_function(lambda t=throughput: t.rate)
        self.m_decisions = counter(registry, "worker_kv_load_decision_tokens",
                                   "Prompt tokens held in a lower tier that load-or-recompute loaded or recomputed, "
                                   "by tier.", ["tier", "decision"])
        self._seen = dict.fromkeys(DECISIONS, 0)
        for tier, outcome in DECISIONS:
            self.m_decisions.labels(tier, outcome)

    def update(self) -> None:
        """Add the tokens decided since the last call (the counts only ever grow)."""
        for key, seen in self._seen.items():
            value = self.rates.decisions.get(key, 0)
            if value > seen:
                self.m_decisions.labels(*key).inc(value - seen)
                self._seen[key] = value
