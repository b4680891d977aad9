"""Prometheus metrics of a worker's host-memory KV tier, from the reports its engine gives (`Engine.host_tier_report`):
`update()` (at every heartbeat) adds what changed since the last call."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from deepinfer.engine import HostTierReport
from deepinfer.telemetry import HIT_AGE_BUCKETS_S, counter, gauge, histogram

#: (metric name, documentation, the report's field): counters, as running totals.
_COUNTERS = (
    ("worker_host_tier_hit_blocks", "Blocks past the device hits found in the host tier at admission or resume (loaded).",
     "hit_blocks"),
    ("worker_host_tier_miss_blocks", "Blocks past the device hits not in the host tier (at admission, or at a resume that loads).",
     "miss_blocks"),
    ("worker_host_tier_offloaded_blocks", "Blocks copied device → host.", "offloaded_blocks"),
    ("worker_host_tier_offloaded_bytes", "Bytes copied device → host.", "offloaded_bytes"),
    ("worker_host_tier_loaded_blocks", "Blocks copied host → device.", "loaded_blocks"),
    ("worker_host_tier_loaded_bytes", "Bytes copied host → device.", "loaded_bytes"),
    ("worker_host_tier_failed_loads", "Loads that could not be issued (recomputed).", "failed_loads"),
    ("worker_host_tier_evictions", "Blocks evicted from the host tier (LRU).", "evictions"),
    ("worker_host_tier_skipped_offloads", "Offloads skipped: every host slot was pinned by a copy.", "skipped_offloads"),
)


class HostTierMetrics:
    """The host tier's counters, load latency and occupancy on a worker's registry."""

    def __init__(self, registry: CollectorRegistry, capacity_bytes: int) -> None:
        self._counters = [(counter(registry, name, doc), field) for name, doc, field in _COUNTERS]
        self._seen = [0] * len(self._counters)
        self.m_load_s = histogram(registry, "worker_host_tier_load_seconds",
                                  "A host-tier load: issue to completion seen at a step's start.")
        self.m_offload_s = histogram(registry, "worker_host_tier_offload_seconds",
                                     "A host-tier offload: issue to completion seen at a step's start.")
        self.m_hit_age = histogram(registry, "worker_host_tier_hit_age_seconds",
                                   "Seconds since a loaded block's previous use (how long the tier kept it).",
                                   buckets=HIT_AGE_BUCKETS_S)
        self.m_used = gauge(registry, "worker_host_tier_used_bytes", "Bytes of host slots in use.")
        gauge(registry, "worker_host_tier_capacity_bytes", "Bytes of the host tier.").set(capacity_bytes)

    def update(self, report: HostTierReport) -> None:
        """Add the counts since the last report (the engine thread only ever increases them) and its samples."""
        for i, (metric, field) in enumerate(self._counters):
            value = getattr(report, field)
            if value > self._seen[i]:
                metric.inc(value - self._seen[i])
                self._seen[i] = value
        for seconds in report.load_seconds:
            self.m_load_s.observe(seconds)
        for seconds in report.offload_seconds:
            self.m_offload_s.observe(seconds)
        for age in report.hit_ages:
            self.m_hit_age.observe(max(0.0, age))
        self.m_used.set(report.used_bytes)
