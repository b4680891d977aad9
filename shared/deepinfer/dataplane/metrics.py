"""Counters of a data-plane server or client; plain ints the owner reads and exports (e.g. to Prometheus)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DataPlaneMetrics:
    """Running totals since start; payload bytes only (headers and handshakes are not counted)."""

    connections: int = 0
    auth_failures: int = 0
    requests: int = 0
    errors: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter by name."""
        return asdict(self)
