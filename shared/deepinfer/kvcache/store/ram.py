"""The RAM tier: payloads by key, LRU by bytes.

    LRU order (an OrderedDict): first = least recently used (evicted first) ... last = most recently used

A use (get or put) moves a block to the end, so with a clock that does not go back the order is also ascending
last-use time, and expiry can stop at the first block that has not expired. Not thread-safe: the store's state
lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from deepinfer.dataplane.frames import BytesLike

#: A block's identity in the store: (layout_id, block_hash).
Key = tuple[str, bytes]


@dataclass(slots=True)
class RamEntry:
    """One block held in memory; `payload` is immutable and handed out uncopied."""

    payload: BytesLike  # bytes or a read-only view: never written
    last_used_s: float


class RamTier:
    """Blocks in memory up to `capacity_bytes` of payload, least recently used evicted first."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[Key, RamEntry] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> RamEntry | None:
        """The entry, without counting a use."""
        return self._entries.get(key)

    def payload(self, key: Key) -> BytesLike:
        """The block's bytes, uncopied."""
        return self._entries[key].payload

    def use(self, key: Key, now_s: float) -> None:
        """Record a use: last_used_s = now_s, and the block becomes the most recently used."""
        entry = self._entries[key]
        entry.last_used_s = max(entry.last_used_s, now_s)  # a clock stepping back never makes a block older
        self._entries.move_to_end(key)

    def put(self, key: Key, payload: BytesLike, last_used_s: float) -> list[Key]:
        """Hold a block as the most recently used; the keys evicted to make room, LRU first.

        A payload larger than the whole tier is not held (nothing is evicted for it).
        """
        size = len(payload)
        if key in self._entries:
            self.use(key, last_used_s)
            return []
        if size > self.capacity_bytes:
            return []
        evicted = []
        while self.used_bytes + size > self.capacity_bytes:
            old_key, old = self._entries.popitem(last=False)
            self.used_bytes -= len(old.payload)
            evicted.append(old_key)
        self._entries[key] = RamEntry(payload, last_used_s)
        self.used_bytes += size
        return evicted

    def remove(self, key: Key) -> bool:
        """Drop a block; False when it was not held."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.used_bytes -= len(entry.payload)
        return True

    def expired(self, now_s: float, ttl_s: float) -> list[Key]:
        """Keys unused for more than ttl_s, oldest first (not removed)."""
        found = []
        for key, entry in self._entries.items():
            if now_s - entry.last_used_s <= ttl_s:
                break
            found.append(key)
        return found

    def keys(self) -> list[Key]:
        """Every held key, least recently used first."""
        return list(self._entries)


def held_payload(payload: BytesLike) -> BytesLike:
    """What the store keeps of a payload: `bytes` and read-only views as given, uncopied (the data plane hands
    over the buffers it received into and never writes them again), a copy of any writable buffer."""
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, memoryview) and payload.readonly and payload.c_contiguous:
        return payload if payload.format == "B" and payload.ndim == 1 else payload.cast("B")
    return bytes(payload)
