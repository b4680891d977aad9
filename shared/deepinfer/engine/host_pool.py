"""The host tier's bookkeeping: which block hash each host slot holds, LRU order, pins. No torch.

A slot's life (its bytes live in deepinfer.engine.host_tier's pinned tensor):

    free ─ reserve(hash) ─► writing (pinned, not indexed) ─ commit ─► indexed (LRU) ─ reserve(other) evicts ─► ...
                                                         └ abort ─► free
    indexed ─ pin (a load reads it) ─► pinned ─ unpin ─► indexed
    indexed ─ pin_held (write-behind reads it off the engine thread) ─► pinned ─ unpin ─► indexed

Only indexed slots are hits, so a block is found only once its device→host copy completed; a pinned slot (being
written, or read by a load) is never evicted or reused. A full pool evicts its least recently used unpinned slot;
with none, reserve() answers None and counts a skipped offload.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from deepinfer.engine.block_pool import KvCacheEvent, Removed, Stored

#: The tier name in KV events and cached_tokens_by_tier.
HOST_TIER = "host"
#: Hit ages kept until the metrics take them (a bound: nobody reading them never grows memory).
MAX_PENDING_HIT_AGES = 4096


class HostPool:
    """num_slots block slots: hash → slot index (LRU order), pins, and the host tier's KV events."""

    def __init__(self, num_slots: int, enable_events: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.enable_events = enable_events
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        #: Committed slots, least recently used first.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._writing: dict[bytes, int] = {}
        self._slot_hash: list[bytes | None] = [None] * num_slots
        self._pins = [0] * num_slots
        self._clock = clock
        #: When each slot's block was last used (written, or read by a load).
        self._last_use = [0.0] * num_slots
        #: Seconds since its previous use of every block a load read, oldest first (taken by the metrics).
        self.hit_ages: deque[float] = deque(maxlen=MAX_PENDING_HIT_AGES)
        self._events: list[KvCacheEvent] = []
        self.num_evictions = 0
        self.num_skipped = 0

    @property
    def num_used(self) -> int:
        """Slots holding a block or being written."""
        return self.num_slots - len(self._free)

    def __contains__(self, block_hash: bytes) -> bool:
        """Held or being written: no need to offload it again."""
        return block_hash in self._index or block_hash in self._writing

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding this block, once its copy completed (no LRU change)."""
        return self._index.get(block_hash)

    def num_leading_hits(self, block_hashes: Sequence[bytes]) -> int:
        """How many of block_hashes, from the first, the pool holds."""
        return next((i for i, h in enumerate(block_hashes) if h not in self._index), len(block_hashes))

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot to write this block into, pinned and not found until commit(); None (counted) when every slot
        is pinned."""
        assert block_hash not in self, "block already held or being written"
        slot = self._free.pop() if self._free else self._evict_lru()
        if slot is None:
            self.num_skipped += 1
            return None
        self._slot_hash[slot] = block_hash
        self._pins[slot] = 1
        self._writing[block_hash] = slot
        return slot

    def commit(self, slots: Sequence[int]) -> None:
        """The slots' copies completed: unpin them and make them hits (one Stored event)."""
        stored = []
        for slot in slots:
            block_hash = self._slot_hash[slot]
            assert block_hash is not None and self._writing.pop(block_hash) == slot, f"slot {slot} not written"
            self._pins[slot] -= 1
            self._index[block_hash] = slot
            self._last_use[slot] = self._clock()
            stored.append(block_hash)
        if stored and self.enable_events:
            self._events.append(Stored(stored, None, tier=HOST_TIER))

    def abort(self, slots: Sequence[int]) -> None:
        """The slots' copies failed: back to free, never found."""
        for slot in slots:
            block_hash = self._slot_hash[slot]
            assert block_hash is not None and self._writing.pop(block_hash) == slot, f"slot {slot} not written"
            self._slot_hash[slot], self._pins[slot] = None, 0
            self._free.append(slot)

    def pin(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Pin held blocks for a load (most recently used now); their slots, in order."""
        slots, now = [], self._clock()
        for block_hash in block_hashes:
            slot = self._index[block_hash]
            self._index.move_to_end(block_hash)
            self._pins[slot] += 1
            self.hit_ages.append(now - self._last_use[slot])
            self._last_use[slot] = now
            slots.append(slot)
        return slots

    def pin_held(self, block_hashes: Sequence[bytes]) -> list[int | None]:
        """Pin the held ones among block_hashes for a reader that is not a load (write-behind): no LRU change, no
        use recorded. Their slots, None for blocks not held; unpin() the slots when done."""
        slots: list[int | None] = []
        for block_hash in block_hashes:
            slot = self._index.get(block_hash)
            if slot is not None:
                self._pins[slot] += 1
            slots.append(slot)
        return slots

    def unpin(self, slots: Sequence[int]) -> None:
        """A load (or write-behind) finished reading these slots."""
        for slot in slots:
            assert self._pins[slot] > 0, f"slot {slot} is not pinned"
            self._pins[slot] -= 1

    def is_pinned(self, slot: int) -> bool:
        """True while a copy writes or reads the slot."""
        return self._pins[slot] > 0

    def block_hashes(self) -> list[bytes]:
        """The held blocks, least recently used first."""
        return list(self._index)

    def take_events(self) -> list[KvCacheEvent]:
        """Host-tier Stored / Removed since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _evict_lru(self) -> int | None:
        victim = next((h for h, slot in self._index.items() if self._pins[slot] == 0), None)
        if victim is None:
            return None
        slot = self._index.pop(victim)
        self._slot_hash[slot] = None
        self.num_evictions += 1
        if self.enable_events:
            self._events.append(Removed([victim], tier=HOST_TIER))
        return slot
