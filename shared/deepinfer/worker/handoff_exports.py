"""`HandoffExports`: a prefill worker's handed-off KV blocks, leased to decode workers' transfer engines.

The worker's KV export buffers are one SlotRegion (deepinfer.kvcache.shm.region: slot headers under a seqlock,
then the slots) in anonymous memory of this process, registered whole with its transfer engine once, at start;
a decode worker reads the slots it was leased with one TE batch (deepinfer.kvcache.client.remote):

    decode ── lease(request_id, block_ids, via=transfer_engine)   data plane (HMAC) ──► prefill worker
              the request still holds those blocks? (else LeaseExpired) → the engine thread exports them →
              lease(): each block copied into a free slot under the seqlock
           ◄─ lease_id, RemoteRegion {session_id, headers / slots addresses, slot_bytes},
              per block: slot, seq, size, xxh3-64, digest of (layout_id, request id / block id)
    one TE batch: the slots' bytes; one TE batch: their headers (seq unchanged?); xxh3-64 of each block
    ── release(lease_id) ──► the slots are free again

Slot lifecycle:   free ──lease──► leased ──release(lease_id) / end_request(request_id)──► free

A slot is rewritten only once free, so a reader never sees another block under its lease; a reader past its
lease's end (the request's lease expired: `end_request`) fails the seq check of a rewritten slot. No free slot
for every block of a lease: `NoExportRoom` (the reader takes the data-plane get of the same blocks).

Only what is leased is in the region: whoever reaches the engine's ports can read (and write) those slots by
address (docs/dataplane.md, "P/D handoff through the same transport"). Thread-safe.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence

from deepinfer.dataplane.errors import DataPlaneError
from deepinfer.dataplane.frames import BytesLike, RemoteRegion
from deepinfer.dataplane.transfer_engine import TransferEngine
from deepinfer.kvcache.shm.region import PAGE, SlotRegion, key_digest, round_up
from deepinfer.kvcache.shm.tier import SlotLease


class NoExportRoom(DataPlaneError):
    """Not enough free export slots for a lease's blocks (or a block larger than a slot)."""


def export_digest(layout_id: str, request_id: str, block_id: int) -> int:
    """What a handoff slot's header names: (layout_id, request id / block id), as a store slot names its key."""
    return key_digest(layout_id, f"{request_id}/{block_id}".encode())


class HandoffExports:
    """capacity_bytes of export slots of one block each (block_nbytes rounded up to a page), registered with
    `engine`; leased per request id.

    Lifecycle: build (maps and registers the region) → `lease` / `release` / `end_request` from any thread →
    `close()` (unregisters before it unmaps: the engine must never serve unmapped memory).
    """

    def __init__(self, engine: TransferEngine, capacity_bytes: int, block_nbytes: int) -> None:
        slot_bytes = round_up(block_nbytes, PAGE)
        num_slots = capacity_bytes // slot_bytes
        if num_slots <= 0:
            raise ValueError(f"{capacity_bytes} bytes of handoff exports hold no {block_nbytes}-byte block")
        self.region = SlotRegion(None, num_slots, slot_bytes)
        self._engine = engine
        engine.register(self.region.address, self.region.layout.size_bytes)
        self.remote_region = RemoteRegion(session_id=engine.session_id, headers_address=self.region.address + PAGE,
                                          slots_address=self.region.address + self.region.layout.data_offset,
                                          slot_bytes=slot_bytes)
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() takes slot 0 first
        self._leases: dict[str, tuple[str, list[int]]] = {}  # lease id -> (request id, slots)

    @property
    def num_slots(self) -> int:
        """Slots in the region."""
        return self.region.layout.num_slots

    @property
    def num_free_slots(self) -> int:
        """Slots no live lease names."""
        with self._lock:
            return len(self._free)

    def lease(self, request_id: str, block_ids: Sequence[int], layout_id: str,
              payloads: Sequence[BytesLike]) -> SlotLease:
        """Copy each block's payload into a free slot and lease them all under one lease id (NoExportRoom when
        they do not fit: nothing is taken)."""
        if len(block_ids) != len(payloads):
            raise ValueError(f"{len(block_ids)} block ids but {len(payloads)} payloads")
        if any(memoryview(p).nbytes > self.region.layout.slot_bytes for p in payloads):
            raise NoExportRoom(f"a block is larger than a {self.region.layout.slot_bytes}-byte export slot")
        with self._lock:
            if len(payloads) > len(self._free):
                raise NoExportRoom(f"{len(payloads)} blocks to export, {len(self._free)} of {self.num_slots} "
                                   "export slots free")
            slots = [self._free.pop() for _ in payloads]
            refs = [self.region.write(slot, payload, export_digest(layout_id, request_id, block_id))
                    for slot, payload, block_id in zip(slots, payloads, block_ids, strict=True)]
            lease_id = secrets.token_hex(8)
            self._leases[lease_id] = (request_id, slots)
        return SlotLease(lease_id, "", refs, self.remote_region)

    def release(self, lease_id: str) -> bool:
        """The reader is done: the lease's slots are free again. False for an unknown or ended lease."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._free += lease[1]
        return lease is not None

    def end_request(self, request_id: str) -> int:
        """The request's lease ended on the worker (Release, expiry, cancel): end its export leases too; how many."""
        with self._lock:
            ended = [lease_id for lease_id, (owner, _) in self._leases.items() if owner == request_id]
            for lease_id in ended:
                self._free += self._leases.pop(lease_id)[1]
        return len(ended)

    def close(self) -> None:
        """Unregister the region, then unmap it."""
        self._engine.unregister(self.region.address)
        self.region.close()
