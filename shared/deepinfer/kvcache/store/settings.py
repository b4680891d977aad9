"""The storage engine's knobs: one frozen dataclass, validated when built (the service maps its settings onto it)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from deepinfer.defaults import (
    DEFAULT_STORE_DISK_BYTES,
    DEFAULT_STORE_FSYNC,
    DEFAULT_STORE_RAM_BYTES,
    DEFAULT_STORE_TTL_S,
)


class FsyncPolicy(StrEnum):
    """When appended records are forced to stable storage (docs/kvstore.md: what an OS crash can lose)."""

    #: Never on the write path: an OS crash or power loss loses what the kernel had not yet written back
    #: (Linux: up to ~30 s of writes). A process crash (kill -9) loses nothing: the page cache survives it.
    NONE = "none"
    #: One fdatasync at the end of each write_blocks call: nothing it returned for is lost.
    BATCH = "batch"
    #: One fdatasync per record: at most the record being written is lost.
    ALWAYS = "always"


@dataclass(frozen=True)
class StoreSettings:
    """Capacity, retention and durability of one store shard; `disk_dir=None` keeps blocks in RAM only."""

    #: RAM tier capacity: payload bytes of the blocks held in memory (LRU by bytes). 0 disables the tier.
    ram_bytes: int = DEFAULT_STORE_RAM_BYTES
    #: Directory of the segment files; None for a RAM-only store (nothing survives a restart).
    disk_dir: Path | None = None
    #: Disk tier capacity: bytes of the live records (header + key + payload, touch records included).
    disk_bytes: int = DEFAULT_STORE_DISK_BYTES
    #: A block expires this long after its last use (get or put), in every tier.
    ttl_s: float = DEFAULT_STORE_TTL_S
    #: A segment file is sealed once the next record would take it past this size.
    segment_bytes: int = 256 << 20
    fsync: FsyncPolicy = FsyncPolicy(DEFAULT_STORE_FSYNC)
    #: Check every payload's checksum while rebuilding the index (reads all data once); False checks headers
    #: only and leaves payloads to the per-read check (which always runs).
    verify_on_open: bool = True
    #: A use is recorded on disk (a small touch record) at most once per block per this many seconds: after a
    #: restart a block's age is at most this much older than the truth.
    touch_interval_s: float = 600.0
    #: A sealed segment whose live bytes fall under this fraction of its size is rewritten by compaction.
    compact_live_fraction: float = 0.5
    #: Bytes of live records one compaction step copies at most (a step holds the write lock, not readers).
    compact_step_bytes: int = 64 << 20
    #: Stored/expired/evicted events kept for `take_events`; the oldest are dropped (and counted) past this.
    max_pending_events: int = 1 << 20
    #: A directory on a tmpfs (/dev/shm) to put the RAM tier in, as a region of fixed slots that workers on
    #: this host map and read under leases (deepinfer.kvcache.shm); None keeps it on the heap.
    shm_dir: Path | None = None
    #: Bytes of one shared-memory slot (rounded up to 4 KiB): a block larger than this is not held in RAM.
    shm_slot_bytes: int = 2 << 20
    #: A lease on shared-memory slots ends this long after it was granted unless released first.
    shm_lease_s: float = 30.0

    def __post_init__(self) -> None:
        if self.disk_dir is not None and not isinstance(self.disk_dir, Path):
            object.__setattr__(self, "disk_dir", Path(self.disk_dir))
        for name in ("ram_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"StoreSettings.{name} must be >= 0, got {getattr(self, name)}")
        if self.shm_dir is not None and not isinstance(self.shm_dir, Path):
            object.__setattr__(self, "shm_dir", Path(self.shm_dir))
        for name in ("ttl_s", "segment_bytes", "compact_step_bytes", "max_pending_events", "shm_slot_bytes",
                     "shm_lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"StoreSettings.{name} must be positive, got {getattr(self, name)}")
        if self.disk_dir is None and self.ram_bytes == 0:
            raise ValueError("StoreSettings with neither disk_dir nor ram_bytes would hold nothing")
        if self.touch_interval_s < 0:
            raise ValueError(f"StoreSettings.touch_interval_s must be >= 0, got {self.touch_interval_s}")
        if not 0.0 < self.compact_live_fraction <= 1.0:
            raise ValueError(
                f"StoreSettings.compact_live_fraction must be in (0, 1], got {self.compact_live_fraction}"
            )
        object.__setattr__(self, "fsync", FsyncPolicy(self.fsync))
