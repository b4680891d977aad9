"""Prometheus metrics of one store, per tier (`ram`, `disk`), on a registry the owner passes in.

Reads are timed per block (a get mixes tiers), writes per write_blocks call (what a client waits for). The age of
a hit is the time since the block's previous use: the quantity ttl_s bounds, so its histogram shows how many
hits a shorter TTL would lose.
"""

from __future__ import annotations

from enum import StrEnum

from prometheus_client import CollectorRegistry

from deepinfer.kvcache.store.disk import OpenReport
from deepinfer.kvcache.store.scan import CorruptReason
from deepinfer.telemetry import HIT_AGE_BUCKETS_S, counter, gauge, histogram

#: Per-block and per-call latencies: 10 us (a RAM hit) .. 1 s (a large fsync'd batch).
STORE_LATENCY_BUCKETS_S = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


class Tier(StrEnum):
    """A storage tier (the `tier` label)."""

    RAM = "ram"
    DISK = "disk"


class StoreMetrics:
    """The store's counters, gauges and histograms (names under `deepinfer_kvstore_`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.hits = counter(registry, "kvstore_hits", "Blocks served from a tier", ["tier"])
        self.misses = counter(
            registry, "kvstore_misses", "Blocks looked up in a tier and not found", ["tier"]
        )
        self.evictions = counter(
            registry, "kvstore_evictions", "Blocks dropped from a tier for capacity", ["tier"]
        )
        self.expirations = counter(
            registry, "kvstore_expirations", "Blocks dropped from a tier after ttl_s without use", ["tier"]
        )
        self.corrupt_records = counter(
            registry,
            "kvstore_corrupt_records",
            "Disk records never served: torn, bad header or bad payload",
            ["reason"],
        )
        self.compacted_bytes = counter(
            registry, "kvstore_compacted_bytes", "Disk bytes reclaimed by compaction"
        )
        self.blocks = gauge(registry, "kvstore_blocks", "Blocks held by a tier", ["tier"])
        self.bytes = gauge(
            registry, "kvstore_bytes", "Bytes held by a tier (RAM: payloads; disk: live records)", ["tier"]
        )
        self.disk_file_bytes = gauge(
            registry, "kvstore_disk_file_bytes", "Bytes of the segment files, dead included"
        )
        self.hit_age = histogram(
            registry,
            "kvstore_hit_age_seconds",
            "Seconds since a hit block's previous use",
            ["tier"],
            HIT_AGE_BUCKETS_S,
        )
        self.read_seconds = histogram(
            registry,
            "kvstore_read_seconds",
            "Seconds to load one block from a tier",
            ["tier"],
            STORE_LATENCY_BUCKETS_S,
        )
        self.write_seconds = histogram(
            registry,
            "kvstore_write_seconds",
            "Seconds to store one write_blocks call's new blocks in a tier (fsync included)",
            ["tier"],
            STORE_LATENCY_BUCKETS_S,
        )
        for tier in Tier:  # every series exists from the start, at 0
            for metric in (self.hits, self.misses, self.evictions, self.expirations, self.blocks, self.bytes):
                metric.labels(tier=tier)
        for reason in CorruptReason:
            self.corrupt_records.labels(reason=reason)

    def hit(self, tier: Tier, age_s: float, read_s: float) -> None:
        """One block served from `tier`."""
        self.hits.labels(tier=tier).inc()
        self.hit_age.labels(tier=tier).observe(max(0.0, age_s))
        self.read_seconds.labels(tier=tier).observe(read_s)

    def opened(self, report: OpenReport) -> None:
        """Count what rebuilding the disk index dropped: corrupt records, expired and over-capacity blocks."""
        for reason, count in report.corrupt.items():
            self.corrupt_records.labels(reason=reason).inc(count)
        self.expirations.labels(tier=Tier.DISK).inc(report.num_expired)
        self.evictions.labels(tier=Tier.DISK).inc(report.num_evicted)

    def usage(self, tier: Tier, num_blocks: int, num_bytes: int) -> None:
        """Set what a tier holds now."""
        self.blocks.labels(tier=tier).set(num_blocks)
        self.bytes.labels(tier=tier).set(num_bytes)
