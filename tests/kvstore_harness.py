"""Helpers of the kvcache store tests: distinct block hashes and payloads."""

from __future__ import annotations

import random

LAYOUT = "layout-a"
OTHER_LAYOUT = "layout-b"
KiB = 1 << 10
MiB = 1 << 20


def block_hash(name: str) -> bytes:
    """A 16-byte hash spelling `name` (readable in assertion messages)."""
    return name.encode().ljust(16, b"\x00")


def hashes(*names: str) -> list[bytes]:
    """block_hash of each name."""
    return [block_hash(n) for n in names]


def payload(name: str, size_bytes: int = 4 * KiB) -> bytes:
    """Random bytes seeded by `name` (never zeros, so a misplaced block cannot pass for another)."""
    return random.Random(name).randbytes(size_bytes)
