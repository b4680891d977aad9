"""Helpers of the kvcache store tests: a hand-moved wall clock, distinct block hashes and payloads, open/reopen."""

from __future__ import annotations

import random
from pathlib import Path

from prometheus_client import CollectorRegistry

from deepinfer.kvcache.store import KvStore, StoreSettings

LAYOUT = "layout-a"
OTHER_LAYOUT = "layout-b"
KiB = 1 << 10
MiB = 1 << 20
#: A wall-clock start far from 0, as time.time() is.
T0 = 1_800_000_000.0


class FakeClock:
    """Wall-clock seconds that move only when the test says so."""

    def __init__(self, now_s: float = T0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        self.now_s += seconds


def block_hash(name: str) -> bytes:
    """A 16-byte hash spelling `name` (readable in assertion messages)."""
    return name.encode().ljust(16, b"\x00")


def hashes(*names: str) -> list[bytes]:
    """block_hash of each name."""
    return [block_hash(n) for n in names]


def payload(name: str, size_bytes: int = 4 * KiB) -> bytes:
    """Random bytes seeded by `name` (never zeros, so a misplaced block cannot pass for another)."""
    return random.Random(name).randbytes(size_bytes)


def open_store(tmp_path: Path, clock: FakeClock, **overrides) -> tuple[KvStore, CollectorRegistry]:
    """A store on tmp_path/"store" with small tiers (overridable), its own registry and the fake clock."""
    fields = {
        "ram_bytes": 64 * KiB,
        "disk_dir": tmp_path / "store",
        "disk_bytes": 1 * MiB,
        "segment_bytes": 64 * KiB,
    }
    fields.update(overrides)
    registry = CollectorRegistry()
    return KvStore(StoreSettings(**fields), clock=clock, registry=registry), registry


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value (0 when absent): `metric(registry, "kvstore_hits_total", tier="ram")`."""
    value = registry.get_sample_value(f"deepinfer_{name}", labels)
    return 0.0 if value is None else value


def segment_files(tmp_path: Path) -> list[Path]:
    """The store's segment files, oldest first."""
    return sorted((tmp_path / "store").glob("*.seg"))
