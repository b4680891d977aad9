"""What the store reports to its owner: blocks stored, expired, evicted; drained with `take_events`.

The service turns them into `KvStoreEventBatch`es (one per layout) for `di.kvcache.events.<shard>`. Events are
store-level: a block leaving the RAM tier but still on disk is no event (only a metric).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum


class StoreEventKind(StrEnum):
    """What happened to a block (the fields of KvStoreEventBatch)."""

    STORED = "stored"  # a put made the store hold a block it did not hold
    EXPIRED = "expired"  # unused for longer than ttl_s; dropped from every tier
    EVICTED = "evicted"  # dropped for capacity (LRU) or because its record failed its checksum


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """One change to the set of blocks the store holds; `ts` is the store clock's wall-clock seconds."""

    kind: StoreEventKind
    layout_id: str
    block_hash: bytes
    ts: float


class EventBuffer:
    """Events in order, at most `max_events`; past that the oldest are dropped and counted in `num_dropped`.

    An owner that sees num_dropped grow has lost events and should republish a snapshot. Not thread-safe: the
    store's state lock guards it.
    """

    def __init__(self, max_events: int) -> None:
        self._events: deque[StoreEvent] = deque(maxlen=max_events)
        self.num_dropped = 0

    def add(self, kind: StoreEventKind, layout_id: str, block_hash: bytes, ts: float) -> None:
        """Append one event (dropping the oldest when full)."""
        if len(self._events) == self._events.maxlen:
            self.num_dropped += 1
        self._events.append(StoreEvent(kind, layout_id, block_hash, ts))

    def take(self) -> list[StoreEvent]:
        """Every event since the last call, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events
