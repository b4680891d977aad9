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

On a GPU (a `RegionRegistrar` given, and the get given a `SlotDestination`: the device side of a staging chunk),
the bytes skip the CPU too:

    lease ─► the region registered with the device once (cudaHostRegister, read-only | portable, on a worker
             thread; a region that cannot be registered: the CPU copy above) ─► every slot's seq checked
          ─► the destination copies the slots to the device (the engine thread issues one copy per slot on its
             load copy stream, non_blocking: DMA from the registered pages) and returns once the copy's event
             completed ─► every slot's seq checked again (unchanged: the DMA read exactly the leased block)
          ─► (xxh3-64 of each slot, in place, only with `verify_checksums`) ─► release

A changed seq fails the get (TornRead): its blocks come over the data plane into the host rows, and the device
rows the DMA wrote are overwritten from those before the import reads them; nothing torn is ever imported. The
xxh3 pass is off by default on this path: it would make the CPU read every byte the DMA moves (the H200's 4 GiB
for a 32k-token prompt: ~0.3 s of one core, as long as the copy itself), while what can go wrong between a
lease and its copy (a rewrite, an eviction, a shard restart) is what the lease and the seqlock catch. The
checksum guards the bytes of the RAM tier itself, which only the shard writes (a 0600 file, mapped read-only
here), from the payload whose checksum it verified on put; `kv_store_shm_verify_checksums` turns it back on.
A region is unregistered before it is unmapped, and neither happens while a copy reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from deepinfer.dataplane import DataPlaneClient, DataPlaneError
from deepinfer.dataplane.frames import BytesLike, FrameHeader
from deepinfer.kvcache.shm.region import SlotReader, SlotRef

log = logging.getLogger(__name__)

#: Blocks per lease: a lease reply's grants (~100 bytes each) stay far under the data plane's 1 MiB header.
MAX_BLOCKS_PER_LEASE = 1024


class RegisteredRegion(Protocol):
    """A mapped region's slots registered with the device (pinned for DMA): what a SlotDestination copies from."""

    def unregister(self) -> None:
        """Undo the registration (blocking; before the region is unmapped, with no copy reading it)."""


class RegionRegistrar(Protocol):
    """Registers mapped regions with the device (the worker's, on CUDA: deepinfer.engine.slot_dma)."""

    def register(self, slots: np.ndarray) -> RegisteredRegion | None:
        """Register `slots` ([num_slots, slot_bytes] uint8, read-only, page-aligned) once; None when the device
        refuses (the reads then copy on the CPU). Blocking: called on a worker thread."""


class SlotDestination(Protocol):
    """The device side of one staging chunk: where a get copies leased slots instead of host rows."""

    #: Indexes (into the get's blocks) whose bytes are on the device, filled by the get once checked.
    on_device: list[int]

    async def copy(self, region: RegisteredRegion, refs: Sequence[SlotRef], indexes: Sequence[int]) -> None:
        """Copy each ref's slot of `region` into the row of block indexes[i] of the get; return once the copy
        completed on the device. Cancelled, it still returns only then (the lease is released after it)."""


@dataclass(eq=False)
class _Region:
    """One shard's region, mapped (and, on a GPU, registered once)."""

    reader: SlotReader
    #: The registration (a worker thread's), None before the first device get asks for it.
    registered: asyncio.Future[RegisteredRegion | None] | None = None
    #: Device copies reading it now; a region replaced meanwhile is closed when the last one ends.
    num_copies: int = 0
    retired: bool = False


class SharedMemoryReads:
    """Read-only mappings of the regions of shards on this host: one per shard, replaced when the shard names
    another region (it restarted), so a restarted shard's old pages are not kept alive here. With a `registrar`
    (set by a worker on CUDA), gets given a SlotDestination copy slots straight to the device."""

    def __init__(self, host_id: str) -> None:
        self.host_id = host_id
        self._regions: dict[str, _Region] = {}  # shard's data-plane address -> its region, mapped
        self.registrar: RegionRegistrar | None = None
        self._registrations: ThreadPoolExecutor | None = None
        #: The xxh3-64 pass on the device path (the CPU path always verifies): see the module docstring.
        self.verify_checksums = False
        #: Blocks read through shared memory (of them, copied straight to the device), and gets that fell back
        #: to the data plane.
        self.num_blocks = 0
        self.num_device_blocks = 0
        self.num_fallbacks = 0

    def use_device(self, registrar: RegionRegistrar, verify_checksums: bool = False) -> None:
        """Copy slots straight to the device for gets given a SlotDestination (a worker on CUDA, once).
        Registrations and unregistrations run on one thread of their own (slow for a large region; a refused one
        leaves its error in that thread's CUDA state, not in the engine thread's)."""
        self.registrar, self.verify_checksums = registrar, verify_checksums
        if self._registrations is None:
            self._registrations = ThreadPoolExecutor(1, thread_name_prefix="kv-shm-register")

    async def get(self, client: DataPlaneClient, layout_id: str, block_hashes: Sequence[bytes],
                  into: Sequence[memoryview] | None, device: SlotDestination | None = None,
                  indexes: Sequence[int] | None = None) -> list[BytesLike]:
        """The blocks through the shard's shared memory, every one seqlock-checked (and checksum-checked, but on
        the device path only with verify_checksums); raises DataPlaneError (the caller then gets them over the
        data plane). With `device` (and `indexes`: each block's index in the destination's get) the blocks may
        go to the device instead: their entries are then their `into` buffers, unwritten, and their indexes
        are added to device.on_device."""
        if device is not None and (into is None or indexes is None):
            raise ValueError("a device get needs into and indexes")
        blocks: list[BytesLike] = []
        for start in range(0, len(block_hashes), MAX_BLOCKS_PER_LEASE):
            end = start + MAX_BLOCKS_PER_LEASE
            blocks += await self._get_leased(client, layout_id, block_hashes[start:end],
                                             None if into is None else into[start:end], device,
                                             None if indexes is None else indexes[start:end])
        return blocks

    async def prepare(self, client: DataPlaneClient, layout_id: str) -> bool:
        """Map (and register, with a registrar) the shard's region ahead of the first load, by a lease of no
        block: the registration (pinning every page of the region, seconds for tens of GiB) is then not paid
        by a request. True when the region is registered."""
        lease = await client.lease_blocks(layout_id, [], self.host_id)
        with contextlib.suppress(Exception):
            await client.release_lease(lease.lease_id)
        region = self._region(client.address, lease.region_path)
        return self.registrar is not None and await self._registration(region) is not None

    async def _get_leased(self, client: DataPlaneClient, layout_id: str, block_hashes: Sequence[bytes],
                          into: Sequence[memoryview] | None, device: SlotDestination | None,
                          indexes: Sequence[int] | None) -> list[BytesLike]:
        lease = await client.lease_blocks(layout_id, block_hashes, self.host_id)
        try:
            region = self._region(client.address, lease.region_path)
            registered = await self._registration(region) if device is not None else None
            if registered is not None and into is not None and indexes is not None and device is not None:
                return await self._copy_to_device(region, registered, lease, into, device, indexes)
            reader = region.reader
            copy = asyncio.ensure_future(asyncio.to_thread(self._copy, reader, lease, into))  # releases the GIL
            try:
                return await asyncio.shield(copy)
            except asyncio.CancelledError:
                await asyncio.wait([copy])  # the thread writes the caller's buffers: return only once it is done
                raise
        finally:
            with contextlib.suppress(Exception):  # a lease not released ends by time on the shard
                await client.release_lease(lease.lease_id)

    def registered_regions(self) -> list[RegisteredRegion]:
        """The regions mapped and registered with the device so far (what a SlotDestination copies from)."""
        return [r.registered.result() for r in self._regions.values()
                if r.registered is not None and r.registered.done() and not r.registered.cancelled()
                and r.registered.exception() is None and r.registered.result() is not None]

    def close(self) -> None:
        """Unregister and unmap every region (one a copy still reads: when that copy ends)."""
        regions, self._regions = list(self._regions.values()), {}
        for region in regions:
            self._retire(region)
        if self._registrations is not None and not any(r.num_copies for r in regions):
            self._registrations.shutdown(wait=True)  # the unregistrations and unmaps just queued are done

    async def _copy_to_device(self, region: _Region, registered: RegisteredRegion, lease: FrameHeader,
                              into: Sequence[memoryview], device: SlotDestination,
                              indexes: Sequence[int]) -> list[BytesLike]:
        """Seq checked, the slots DMA'd to the destination, seq checked again (and, with verify_checksums, each
        slot's xxh3-64 in place); raises TornRead / ChecksumError (the device rows then hold nothing used)."""
        if region.retired:  # replaced (the shard restarted) while its registration ran: closed or closing
            raise DataPlaneError(f"kv region {region.reader.path} was replaced")
        reader = region.reader
        refs = [SlotRef(g.slot, g.seq, g.size, g.checksum, g.key_digest) for g in lease.slots]
        for ref, buffer in zip(refs, into, strict=True):
            if memoryview(buffer).nbytes != ref.size:
                raise DataPlaneError(f"a {memoryview(buffer).nbytes}-byte row for a {ref.size}-byte block")
            reader.check(ref)
        region.num_copies += 1  # neither unregistered nor unmapped until the checks below are done
        try:
            await device.copy(registered, refs, indexes)
            for ref in refs:
                reader.check(ref, "was rewritten before its copy to the device completed")
            if self.verify_checksums:
                await asyncio.to_thread(lambda: [reader.verify(ref) for ref in refs])
                for ref in refs:  # still the leased bytes after the hash read them
                    reader.check(ref, "was rewritten while its checksum was taken")
        finally:
            region.num_copies -= 1
            if region.retired and not region.num_copies:
                self._close(region)
        device.on_device.extend(indexes)
        self.num_blocks += len(refs)
        self.num_device_blocks += len(refs)
        return list(into)

    async def _registration(self, region: _Region) -> RegisteredRegion | None:
        """The region registered with the device (registering it on a worker thread the first time); None with
        no registrar or when the device refused it."""
        if self.registrar is None:
            return None
        if region.registered is None:
            loop = asyncio.get_running_loop()
            region.registered = loop.run_in_executor(self._registrations, self._register, region.reader)
        return await asyncio.shield(region.registered)

    def _register(self, reader: SlotReader) -> RegisteredRegion | None:
        assert self.registrar is not None
        try:
            return self.registrar.register(reader.slots)
        except Exception:
            log.exception("registering kv region %s with the device failed: copying on the CPU", reader.path)
            return None

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

    def _region(self, address: str, path: str) -> _Region:
        region = self._regions.get(address)
        if region is None or str(region.reader.path) != path:
            if region is not None:
                self._retire(region)
            region = self._regions[address] = _Region(SlotReader(path))
        return region

    def _retire(self, region: _Region) -> None:
        """Close a region no longer used for new gets: now, or when its last device copy ends."""
        region.retired = True
        if not region.num_copies:
            self._close(region)

    def _close(self, region: _Region) -> None:
        """Unregister (once the registration is done, if one is running), then unmap."""
        registration = region.registered
        if registration is not None and not registration.done():
            registration.add_done_callback(lambda _: self._close(region))
            return
        registered = None
        if registration is not None and not registration.cancelled() and registration.exception() is None:
            registered = registration.result()
        if registered is None or self._registrations is None:
            _close(region.reader)
            return
        try:
            self._registrations.submit(_unregister_and_close, registered, region.reader)
        except RuntimeError:  # closed meanwhile (a registration that ended after close()): here, then
            _unregister_and_close(registered, region.reader)


def _unregister_and_close(registered: RegisteredRegion, reader: SlotReader) -> None:
    """On the registration thread: unregister, then unmap (a region CUDA will not unregister stays mapped: its
    pages stay pinned rather than be unmapped under the device's registration)."""
    try:
        registered.unregister()
    except Exception:
        log.exception("unregistering kv region %s failed: kept mapped", reader.path)
        return
    _close(reader)


def _close(reader: SlotReader) -> None:
    """Unmap, unless a copy still reads it (then the mapping goes with its last view)."""
    with contextlib.suppress(BufferError):
        reader.close()
