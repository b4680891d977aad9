"""`SharedMemoryReads`: a worker's gets from a store shard on its own host, through the shard's shared memory.

Today's path for a store get (docs/dataplane.md) is a data-plane `get`: the shard copies each block out of its
RAM tier into a TCP frame, the kernel copies it through loopback, the worker receives it into its staging row
and verifies its xxh3-64. On the same host this replaces the bytes' trip through the socket, and keeps the rules:

    worker ── lease (data plane: HMAC-authenticated connection; layout_id, hashes, our host_id) ──► shard
           ◄─ lease_id, region file, per block: slot, seq, size, xxh3-64, key digest ──
    copy each slot into its staging row from our read-only mapping (seqlock: the seq unchanged before and after;
    then the xxh3-64 verified, as the data plane verifies every block)
    ── release (lease_id) ──► the shard may rewrite the slots

- a block being evicted is never read: a leased slot is retired, not rewritten, until the lease ends
  (deepinfer.kvcache.shm.tier); a reader past its lease sees a changed seq and falls back;
- a torn block is never returned: the seqlock and the checksum (deepinfer.kvcache.shm.region);
- host identity: only a shard whose heartbeat names our host id is asked, and the shard refuses a lease whose
  host id is not its own; the region file is named only in the lease reply, on the authenticated data plane;
- any failure (refused, not in shared memory, torn, the file gone) → the same blocks by the data-plane get.

GPU hook (not built yet): instead of copying a slot into a host staging row, the engine registers
`SlotReader.slots` once per region with `cudaHostRegister` (read-only, portable) and copies each leased slot
straight into the device KV on its copy stream, releasing the lease after the copy's event completes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import numpy as np

from deepinfer.dataplane import DataPlaneClient, DataPlaneError
from deepinfer.dataplane.frames import BytesLike, FrameHeader
from deepinfer.kvcache.shm.region import SlotReader, SlotRef

#: Blocks per lease: a lease reply's grants (~100 bytes each) stay far under the data plane's 1 MiB header.
MAX_BLOCKS_PER_LEASE = 1024


class SharedMemoryReads:
    """Read-only mappings of the regions of shards on this host: one per shard, replaced when the shard names
    another region (it restarted), so a restarted shard's old pages are not kept alive here."""

    def __init__(self, host_id: str) -> None:
        self.host_id = host_id
        self._readers: dict[str, SlotReader] = {}  # shard's data-plane address -> its region, mapped
        #: Blocks read through shared memory, and gets that fell back to the data plane.
        self.num_blocks = 0
        self.num_fallbacks = 0

    async def get(self, client: DataPlaneClient, layout_id: str, block_hashes: Sequence[bytes],
                  into: Sequence[memoryview] | None) -> list[BytesLike]:
        """The blocks through the shard's shared memory, every one seqlock- and checksum-checked; raises
        DataPlaneError (the caller then gets them over the data plane)."""
        blocks: list[BytesLike] = []
        for start in range(0, len(block_hashes), MAX_BLOCKS_PER_LEASE):
            end = start + MAX_BLOCKS_PER_LEASE
            blocks += await self._get_leased(client, layout_id, block_hashes[start:end],
                                             None if into is None else into[start:end])
        return blocks

    async def _get_leased(self, client: DataPlaneClient, layout_id: str, block_hashes: Sequence[bytes],
                          into: Sequence[memoryview] | None) -> list[BytesLike]:
        lease = await client.lease_blocks(layout_id, block_hashes, self.host_id)
        try:
            reader = self._reader(client.address, lease.region_path)
            copy = asyncio.ensure_future(asyncio.to_thread(self._copy, reader, lease, into))  # releases the GIL
            try:
                return await asyncio.shield(copy)
            except asyncio.CancelledError:
                await asyncio.wait([copy])  # the thread writes the caller's buffers: return only once it is done
                raise
        finally:
            with contextlib.suppress(Exception):  # a lease not released ends by time on the shard
                await client.release_lease(lease.lease_id)

    def close(self) -> None:
        """Unmap every region."""
        readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            _close(reader)

    def _copy(self, reader: SlotReader, lease: FrameHeader, into: Sequence[memoryview] | None) -> list[BytesLike]:
        blocks: list[BytesLike] = []
        for i, grant in enumerate(lease.slots):
            buffer = memoryview(np.empty(grant.size, np.uint8)) if into is None else into[i]
            dst = np.frombuffer(buffer, np.uint8)
            if dst.size != grant.size:
                raise DataPlaneError(f"a {dst.size}-byte buffer for a {grant.size}-byte block")
            reader.read_into(SlotRef(grant.slot, grant.seq, grant.size, grant.checksum, grant.key_digest), dst)
            blocks.append(buffer)
        self.num_blocks += len(blocks)
        return blocks

    def _reader(self, address: str, path: str) -> SlotReader:
        reader = self._readers.get(address)
        if reader is None or str(reader.path) != path:
            if reader is not None:
                _close(reader)
            reader = self._readers[address] = SlotReader(path)
        return reader


def _close(reader: SlotReader) -> None:
    """Unmap, unless a copy still reads it (then the mapping goes with its last view)."""
    with contextlib.suppress(BufferError):
        reader.close()
