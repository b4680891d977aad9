"""`TransferEngineReads`: a worker's gets from a store shard on another host through Mooncake Transfer Engine.

The shard registers its slot region (the RAM tier's shared-memory mapping, deepinfer.kvcache.shm) with its
transfer engine; a lease over the authenticated data plane names the engine's session and the region's addresses
(`RemoteRegion`). The worker then, per lease:

    worker ── lease(layout_id, hashes, via=transfer_engine)  (data plane, HMAC) ──► shard
           ◄─ lease_id, remote region (session, headers / slots addresses, slot_bytes), per block: slot, seq,
              size, xxh3-64, key digest ──
    one batch: slot i's bytes ─► its buffer (the staging row)        [the engine: TCP here, RDMA in a cluster]
    one batch: slot i's 32-byte header ─► a local array
    each header: seq == leased seq, size, key digest unchanged? → xxh3-64 of the buffer == the leased one?
    ── release(lease_id) ──► the shard may rewrite the slots

Why the header is read after the bytes, and once: `seq` only grows, and a writer makes it odd before touching a
slot's bytes (deepinfer.kvcache.shm.region); the header batch starts after the bytes batch has completed, so a
seq still equal to the leased one means no write began before the bytes were copied. A lease that ended under
a slow reader (`shm_lease_s`) lets the slot be rewritten: the seq check catches it, the get falls back.

The P/D handoff reads a prefill worker's export slots the same way (`get_held`: a lease by block id under the
owner's request id, deepinfer.worker.handoff_exports), into one buffer registered for the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import numpy as np

from deepinfer.dataplane import ChecksumError, DataPlaneClient, DataPlaneError
from deepinfer.dataplane.frames import BytesLike, FrameHeader, LeaseVia, checksum
from deepinfer.dataplane.transfer_engine import Transfer, TransferEngine, buffer_address
from deepinfer.kvcache.shm.region import CHECKSUM, KEY_DIGEST, SEQ, SIZE, SLOT_HEADER_WORDS, TornRead

log = logging.getLogger(__name__)

#: Blocks per lease (as the shared-memory path: a lease reply's grants stay far under the 1 MiB header).
MAX_BLOCKS_PER_LEASE = 1024
_HEADER_BYTES = SLOT_HEADER_WORDS * 8


class TransferEngineReads:
    """Gets of leased slots through this process's transfer engine, started on first use
    (`TransferEngine.shared(hostname, protocol)`: `hostname` is how peers reach this host)."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 engine: TransferEngine | None = None) -> None:
        self.hostname, self.protocol = hostname, protocol
        self._engine = engine
        self._ranges: list[tuple[int, int]] = []  # registered with the engine when it starts
        #: Blocks read through the transfer engine, and gets that fell back to the data plane.
        self.num_blocks = 0
        self.num_fallbacks = 0

    def engine(self) -> TransferEngine:
        """The engine (started now if need be); raises TransferEngineUnavailable when it cannot load here."""
        if self._engine is None:
            engine = TransferEngine.shared(self.hostname, self.protocol)
            for address, length in self._ranges:
                engine.register(address, length)
            self._engine = engine
        return self._engine

    def register_ranges(self, ranges: Sequence[tuple[int, int]]) -> None:
        """(address, length) ranges the gets will land in (the staging rows: once), registered with the engine
        now if it runs, else when it starts (a worker that never reads through it opens no ports). RDMA reads
        only into registered memory; TCP reads anywhere."""
        self._ranges += ranges
        if self._engine is not None:
            for address, length in ranges:
                self._engine.register(address, length)

    def register(self, buffer) -> None:
        """Register a buffer the gets will land in (as register_ranges)."""
        self.register_ranges([buffer_address(buffer)])

    async def get(self, client: DataPlaneClient, layout_id: str, block_hashes: Sequence[bytes],
                  into: Sequence[memoryview] | None) -> list[BytesLike]:
        """The blocks through the shard's transfer engine, every one seq- and checksum-checked; raises
        DataPlaneError (the caller then gets them over the data plane)."""
        engine = self.engine()
        blocks: list[BytesLike] = []
        for start in range(0, len(block_hashes), MAX_BLOCKS_PER_LEASE):
            end = start + MAX_BLOCKS_PER_LEASE
            blocks += await self._get_leased(engine, client, layout_id, block_hashes[start:end],
                                             None if into is None else into[start:end])
        return blocks

    async def get_held(self, client: DataPlaneClient, request_id: str, block_ids: Sequence[int],
                       layout_id: str) -> list[BytesLike]:
        """A prefill worker's held blocks by id under its request id (the P/D handoff), through its transfer
        engine into one buffer registered for the batch, every one seq- and checksum-checked; raises
        DataPlaneError (the caller then pulls them with the data-plane get)."""
        engine = self.engine()
        blocks: list[BytesLike] = []
        for start in range(0, len(block_ids), MAX_BLOCKS_PER_LEASE):
            ids = list(block_ids[start:start + MAX_BLOCKS_PER_LEASE])
            lease = await client.lease_blocks(layout_id, (), "", LeaseVia.TRANSFER_ENGINE, request_id=request_id,
                                              block_ids=ids)
            blocks += await self._read_lease(engine, client, lease, None)
        return blocks

    async def _get_leased(self, engine: TransferEngine, client: DataPlaneClient, layout_id: str,
                          block_hashes: Sequence[bytes], into: Sequence[memoryview] | None) -> list[BytesLike]:
        lease = await client.lease_blocks(layout_id, block_hashes, "", via=LeaseVia.TRANSFER_ENGINE)
        return await self._read_lease(engine, client, lease, into)

    async def _read_lease(self, engine: TransferEngine, client: DataPlaneClient, lease: FrameHeader,
                          into: Sequence[memoryview] | None) -> list[BytesLike]:
        """Copy a lease's slots (on a thread: the engine blocks), then release it."""
        try:
            copy = asyncio.ensure_future(asyncio.to_thread(self._copy, engine, lease, into))  # blocks a thread
            try:
                return await asyncio.shield(copy)
            except asyncio.CancelledError:
                await asyncio.wait([copy])  # the engine writes the caller's buffers: return only once it is done
                raise
        finally:
            with contextlib.suppress(Exception):  # a lease not released ends by time (the shard; the owner's lease)
                await client.release_lease(lease.lease_id)

    def _copy(self, engine: TransferEngine, lease: FrameHeader, into: Sequence[memoryview] | None) -> list[BytesLike]:
        region = lease.remote_region
        if region is None:
            raise DataPlaneError("a transfer-engine lease without its remote region")
        arena = None
        if into is None:  # one buffer for every block, registered for this batch (RDMA reads only into such)
            arena = np.empty(sum(grant.size for grant in lease.slots), np.uint8)
            offsets = np.cumsum([0] + [grant.size for grant in lease.slots])
            into = [memoryview(arena[offsets[i]:offsets[i + 1]]) for i in range(len(lease.slots))]
        buffers: list[memoryview] = []
        transfers: list[Transfer] = []
        for i, grant in enumerate(lease.slots):
            buffer = into[i]
            address, length = buffer_address(buffer)
            if length != grant.size or grant.size > region.slot_bytes:
                raise DataPlaneError(f"a {length}-byte buffer for a {grant.size}-byte block")
            buffers.append(buffer)
            transfers.append(Transfer(address, region.slots_address + grant.slot * region.slot_bytes, grant.size))
        if arena is not None and arena.nbytes:
            engine.register_buffer(arena)
        try:
            engine.read(region.session_id, transfers)
        finally:
            if arena is not None and arena.nbytes:
                engine.unregister(arena.ctypes.data)
        headers = np.zeros((len(lease.slots), SLOT_HEADER_WORDS), "<u8")  # [num_blocks, 4]: seq|size|xxh3|key
        header_address, _ = buffer_address(headers)
        engine.register(header_address, max(headers.nbytes, 1))
        try:
            engine.read(region.session_id, [
                Transfer(header_address + i * _HEADER_BYTES, region.headers_address + grant.slot * _HEADER_BYTES,
                         _HEADER_BYTES) for i, grant in enumerate(lease.slots)])
        finally:
            engine.unregister(header_address)
        for grant, header, buffer in zip(lease.slots, headers, buffers, strict=True):
            if (int(header[SEQ]), int(header[SIZE]), int(header[KEY_DIGEST])) != (grant.seq, grant.size,
                                                                                   grant.key_digest):
                raise TornRead(f"slot {grant.slot} no longer holds the leased block")
            if int(header[CHECKSUM]) != grant.checksum or checksum(buffer) != grant.checksum:
                raise ChecksumError(f"slot {grant.slot}: checksum mismatch")
        self.num_blocks += len(buffers)
        return list(buffers)

    def close(self) -> None:
        """Nothing to unmap: registrations stay with the process's engine (its owner closes it)."""
