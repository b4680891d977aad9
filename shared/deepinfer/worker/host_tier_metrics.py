"""Prometheus metrics of a worker's host-memory KV tier (deepinfer.engine.host_tier), from the counters the engine
thread keeps: `update()` (at every heartbeat) adds what changed since the last call."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from deepinfer.engine.host_tier import HostTier
from deepinfer.telemetry import HIT_AGE_BUCKETS_S, counter, gauge, histogram

#: (metric name, documentation, how to read it from the tier): counters, as running totals.
_COUNTERS = (
    ("worker_host_tier_hit_blocks", "Blocks past the device hits found in the host tier at admission or resume (loaded).",
     lambda t: t.stats.hit_blocks),
    ("worker_host_tier_miss_blocks", "Blocks past the device hits not in the host tier (at admission, or at a resume that loads).",
     lambda t: t.stats.miss_blocks),
    ("worker_host_tier_offloaded_blocks", "Blocks copied device → host.", lambda t: t.stats.offloaded_blocks),
    ("worker_host_tier_offloaded_bytes", "Bytes copied device → host.", lambda t: t.stats.offloaded_bytes),
    ("worker_host_tier_loaded_blocks", "Blocks copied host → device.", lambda t: t.stats.loaded_blocks),
    ("worker_host_tier_loaded_bytes", "Bytes copied host → device.", lambda t: t.stats.loaded_bytes),
    ("worker_host_tier_failed_loads", "Loads that could not be issued (recomputed).", lambda t: t.stats.failed_loads),
    ("worker_host_tier_evictions", "Blocks evicted from the host tier (LRU).", lambda t: t.pool.num_evictions),
    ("worker_host_tier_skipped_offloads", "Offloads skipped: every host slot was pinned by a copy.",
     lambda t: t.pool.num_skipped),
)


class HostTierMetrics:
    """The host tier's counters, load latency and occupancy on a worker's registry."""

    def __init__(self, registry: CollectorRegistry, tier: HostTier) -> None:
        self.tier = tier
        self._counters = [(counter(registry, name, doc), read) for name, doc, read in _COUNTERS]
        self._seen = [0] * len(self._counters)
        self.m_load_s = histogram(registry, "worker_host_tier_load_seconds",
                                  "A host-tier load: issue to completion seen at a step's start.")
        self.m_offload_s = histogram(registry, "worker_host_tier_offload_seconds",
                                     "A host-tier offload: issue to completion seen at a step's start.")
        self.m_hit_age = histogram(registry, "worker_host_tier_hit_age_seconds",
                                   "Seconds since a loaded block's previous use (how long the tier kept it).",
                                   buckets=HIT_AGE_BUCKETS_S)
        self.m_used = gauge(registry, "worker_host_tier_used_bytes", "Bytes of host slots in use.")
        gauge(registry, "worker_host_tier_capacity_bytes", "Bytes of the host tier.").set(tier.capacity_bytes)

    def update(self) -> None:
        """Add the counts since the last call (the engine thread only ever increases them)."""
        for i, (metric, read) in enumerate(self._counters):
            value = read(self.tier)
            if value > self._seen[i]:
                metric.inc(value - self._seen[i])
                self._seen[i] = value
        load_seconds = self.tier.stats.load_seconds
        while load_seconds:
            self.m_load_s.observe(load_seconds.popleft())
        offload_seconds = self.tier.stats.offload_seconds
        while offload_seconds:
            self.m_offload_s.observe(offload_seconds.popleft())
        hit_ages = self.tier.pool.hit_ages
        while hit_ages:
            self.m_hit_age.observe(max(0.0, hit_ages.popleft()))
        self.m_used.set(self.tier.used_bytes)
