"""In-memory BlockProvider for data-plane tests: leased blocks by id (a worker) and blocks by hash (a store)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer.dataplane.errors import BlockNotFound, DataPlaneError, LeaseExpired
from deepinfer.dataplane.frames import BytesLike, LeaseVia

if TYPE_CHECKING:
    from deepinfer.kvcache.shm import SlotLease
    from deepinfer.worker.handoff_exports import HandoffExports


class InMemoryBlockProvider:
    """A BlockProvider over two dicts; `read_delay_s` makes every read slow (for in-flight / timeout tests).

    leases: request_id → {block_id: (block_hash or None, payload)}; blocks: (layout_id, hash) → payload.
    With `exports` it also leases a request's blocks by id to transfer engines, as a prefill worker with
    `transfer_engine` on (services/prefill/handler.py): export slots held until release or the request's lease ends.
    """

    def __init__(self, read_delay_s: float = 0.0, exports: HandoffExports | None = None) -> None:
        self.read_delay_s = read_delay_s
        self.exports = exports
        self.leases: dict[str, dict[int, tuple[bytes | None, bytes]]] = {}
        self.blocks: dict[tuple[str, bytes], bytes] = {}
        self.num_reads = 0

    def add_lease(
        self,
        request_id: str,
        block_ids: Sequence[int],
        payloads: Sequence[BytesLike],
        block_hashes: Sequence[bytes] | None = None,
    ) -> None:
        """Hold these blocks under the lease `request_id` (hashes, when given, are checked on reads)."""
        hashes: Sequence[bytes | None] = block_hashes if block_hashes is not None else [None] * len(block_ids)
        if not len(block_ids) == len(payloads) == len(hashes):
            raise ValueError("block_ids, payloads and block_hashes must have the same length")
        self.leases[request_id] = {
            int(i): (h, bytes(p)) for i, h, p in zip(block_ids, hashes, payloads, strict=True)
        }

    def end_lease(self, request_id: str) -> None:
        """Forget a lease (and end its export leases); later reads under it raise LeaseExpired."""
        self.leases.pop(request_id, None)
        if self.exports is not None:
            self.exports.end_request(request_id)

    async def lease_blocks(self, layout_id: str, block_hashes: Sequence[bytes], host_id: str,
                           via: LeaseVia = LeaseVia.SHARED_MEMORY, request_id: str = "",
                           block_ids: Sequence[int] = ()) -> SlotLease:
        """A request's blocks by id copied into export slots and leased to a transfer engine."""
        if via != LeaseVia.TRANSFER_ENGINE or self.exports is None or not block_ids:
            raise DataPlaneError("this provider leases held blocks by id to transfer engines only")
        payloads = self._read_leased(request_id, block_ids, block_hashes)
        return self.exports.lease(request_id, block_ids, layout_id, payloads)

    async def release_lease(self, lease_id: str) -> None:
        """A transfer engine's reader is done with its export slots."""
        if self.exports is not None:
            self.exports.release(lease_id)

    async def read_blocks(
        self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes], layout_id: str
    ) -> list[bytes]:
        """Blocks by id within a lease (hashes checked when given), else by (layout_id, hash)."""
        self.num_reads += 1
        if self.read_delay_s:
            await asyncio.sleep(self.read_delay_s)
        if block_ids:
            return self._read_leased(request_id, block_ids, block_hashes)
        missing = [h.hex() for h in block_hashes if (layout_id, bytes(h)) not in self.blocks]
        if missing:
            raise BlockNotFound(
                f"{len(missing)} blocks not held under layout {layout_id!r}, first {missing[0]}"
            )
        return [self.blocks[(layout_id, bytes(h))] for h in block_hashes]

    def _read_leased(
        self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes]
    ) -> list[bytes]:
        lease = self.leases.get(request_id)
        if lease is None:
            raise LeaseExpired(f"no lease for request {request_id!r} (unknown or expired)")
        payloads = []
        for i, block_id in enumerate(block_ids):
            if block_id not in lease:
                raise BlockNotFound(f"block id {block_id} is not part of the lease of request {request_id!r}")
            held_hash, payload = lease[block_id]
            if block_hashes and held_hash is not None and held_hash != bytes(block_hashes[i]):
                raise LeaseExpired(f"block id {block_id} now holds another block (hash {held_hash.hex()})")
            payloads.append(payload)
        return payloads

    async def write_blocks(
        self, layout_id: str, block_hashes: Sequence[bytes], payloads: Sequence[bytes]
    ) -> None:
        """Store blocks by (layout_id, hash)."""
        for block_hash, payload in zip(block_hashes, payloads, strict=True):
            self.blocks[(layout_id, bytes(block_hash))] = bytes(payload)

    async def has_blocks(self, layout_id: str, block_hashes: Sequence[bytes]) -> list[bool]:
        """One flag per hash."""
        return [(layout_id, bytes(h)) in self.blocks for h in block_hashes]
