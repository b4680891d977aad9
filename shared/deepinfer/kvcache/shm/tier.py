"""`ShmRamTier`: the store's RAM tier in a shared-memory SlotRegion, with leases for co-located readers.

Same interface as `deepinfer.kvcache.store.ram.RamTier` (LRU by use; guarded by the store's state lock), but a
block lives in a fixed-size slot of a region workers map, and readers on this host may **lease** blocks:

    lease(keys)     every key held → one SlotRef each (slot, seq, size, checksum, key digest), one lease id,
                    ending `lease_s` after it was granted (or at release)
    evict / remove  the key leaves the index at once; its slot is **retired**, not freed, while a lease on it
                    is live, and freed when the last one ends: a slot a lease names is never rewritten under it
    put             takes a free slot; with none free, evicts the least recently used blocks that no live lease
                    names (a leased block is being read: it is the most recently used in all but name)

Slot lifecycle:   free ──put──► held ──evict/remove──► (leased? retired : free) ──last lease ends──► free

A lease that ends by time (a reader that died) frees its slots; a reader still copying then fails the seqlock
check at the next rewrite (region.py), never returns torn bytes. Data-plane reads copy a block out under the
state lock (`payload`): the slot may be rewritten once the lock is released.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from deepinfer.dataplane.errors import ChecksumError
from deepinfer.dataplane.frames import BytesLike, RemoteRegion, checksum
from deepinfer.kvcache.shm.region import SlotRef, SlotRegion, key_digest, round_up

#: A block's identity in the store: (layout_id, block_hash) (the store's `ram.Key`; not imported: the store
#: imports this package).
Key = tuple[str, bytes]


@dataclass(slots=True)
class ShmEntry:
    """One block held in a slot."""

    ref: SlotRef
    last_used_s: float


@dataclass(frozen=True)
class SlotLease:
    """Blocks a reader may copy out of the region until `expires_s` (monotonic) or release."""

    lease_id: str
    region_path: str
    refs: list[SlotRef]
    #: For a transfer-engine reader on another host: where the region is in the shard's engine (None: same host).
    remote_region: RemoteRegion | None = None


class ShmRamTier:
    """Blocks in shared-memory slots (capacity_bytes // slot_bytes of them), LRU, leased to local readers."""

    def __init__(self, capacity_bytes: int, directory: Path, slot_bytes: int, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        slot_bytes = round_up(slot_bytes)
        num_slots = capacity_bytes // slot_bytes
        if num_slots <= 0:
            raise ValueError(f"a shared-memory RAM tier of {capacity_bytes} bytes holds no {slot_bytes}-byte slot")
        self.capacity_bytes = num_slots * slot_bytes
        self.slot_bytes, self.lease_s = slot_bytes, lease_s
        self.used_bytes = 0
        self.region = SlotRegion(directory, num_slots, slot_bytes)
        self._clock = clock
        self._entries: OrderedDict[Key, ShmEntry] = OrderedDict()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() takes slot 0 first
        self._retired: set[int] = set()
        self._leases: dict[str, tuple[float, list[int]]] = {}  # lease id -> (expires_s, slots)
        self._lease_counts: Counter[int] = Counter()

    # -- RamTier's interface ------------------------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> ShmEntry | None:
        """The entry, without counting a use."""
        return self._entries.get(key)

    def payload(self, key: Key) -> bytes:
        """A copy of the block's bytes (the slot may be rewritten once the caller releases the state lock),
        checked against the checksum it was written with: a region registered with a transfer engine can be
        written by any peer that reaches the engine (docs/dataplane.md, "Transfer engine"). Raises
        ChecksumError for a slot whose bytes changed."""
        ref = self._entries[key].ref
        data = bytes(self.region.view(ref.slot, ref.size))
        if checksum(data) != ref.checksum:
            raise ChecksumError(f"slot {ref.slot}: its bytes no longer match the block written there")
        return data

    def use(self, key: Key, now_s: float) -> None:
        """Record a use: the block becomes the most recently used."""
        entry = self._entries[key]
        entry.last_used_s = max(entry.last_used_s, now_s)
        self._entries.move_to_end(key)

    def put(self, key: Key, payload: BytesLike, last_used_s: float) -> list[Key]:
        """Copy a block into a free slot as the most recently used; the keys evicted to free one, LRU first.

        A block larger than a slot, or arriving when every held block is leased, is not held (nothing is
        evicted for it; the store still has it on disk).
        """
        if key in self._entries:
            self.use(key, last_used_s)
            return []
        size = memoryview(payload).nbytes
        if size > self.slot_bytes:
            return []
        self.sweep_leases()
        evicted = [] if self._free else self._evict_one_unleased()
        if not self._free:
            return evicted
        slot = self._free.pop()
        ref = self.region.write(slot, payload, key_digest(*key))
        self._entries[key] = ShmEntry(ref, last_used_s)
        self.used_bytes += size
        return evicted

    def remove(self, key: Key) -> bool:
        """Drop a block; its slot is retired while leased. False when it was not held."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.used_bytes -= entry.ref.size
        self._release_slot(entry.ref.slot)
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

    # -- leases -------------------------------------------------------------------------------------------------
    def lease(self, keys: Sequence[Key]) -> SlotLease | None:
        """One lease over every key's slot; None unless every key is held (the caller serves them otherwise)."""
        entries = [self._entries.get(key) for key in keys]
        if any(entry is None for entry in entries):
            return None
        self.sweep_leases()
        lease_id = secrets.token_hex(8)
        refs = [entry.ref for entry in entries if entry is not None]
        slots = [ref.slot for ref in refs]
        self._leases[lease_id] = (self._clock() + self.lease_s, slots)
        self._lease_counts.update(slots)
        return SlotLease(lease_id, str(self.region.path), refs)

    def release(self, lease_id: str) -> bool:
        """End a lease early (the reader is done); False when it was unknown or had ended."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._end(lease[1])
        return True

    def sweep_leases(self) -> None:
        """End every lease past its time."""
        now = self._clock()
        for lease_id in [i for i, (expires_s, _) in self._leases.items() if expires_s <= now]:
            self._end(self._leases.pop(lease_id)[1])

    @property
    def num_leases(self) -> int:
        """Live leases (some may be past their time until the next sweep)."""
        return len(self._leases)

    def is_leased(self, slot: int) -> bool:
        """A live lease names this slot."""
        return self._lease_counts[slot] > 0

    def close(self) -> None:
        """Unmap and unlink the region (workers' mappings stay valid until they unmap)."""
        self.region.close()

    # -- internals ----------------------------------------------------------------------------------------------
    def _evict_one_unleased(self) -> list[Key]:
        for key, entry in self._entries.items():
            if not self.is_leased(entry.ref.slot):
                self.remove(key)
                return [key]
        return []

    def _end(self, slots: list[int]) -> None:
        self._lease_counts.subtract(slots)
        for slot in slots:
            if self._lease_counts[slot] <= 0:
                del self._lease_counts[slot]
                if slot in self._retired:
                    self._retired.discard(slot)
                    self._free.append(slot)

    def _release_slot(self, slot: int) -> None:
        if self.is_leased(slot):
            self._retired.add(slot)
        else:
            self._free.append(slot)
