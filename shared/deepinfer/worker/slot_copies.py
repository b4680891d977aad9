"""`ChunkSlotCopies`: the device side of one staging chunk, as the store client's SlotDestination: leased
shared-memory slots copied straight into the chunk's device rows by the engine thread (deepinfer.engine.slot_dma),
so a same-host store hit on a GPU never passes through the CPU (docs/kvstore.md, "Same host: the shared-memory RAM
tier").

    event loop: get ─ lease ─ seq checked ─► copy(): CopySlots to the engine thread (issued between steps on the
    pool's load copy stream) ─ its event waited for on a thread ─► seq checked again ─► on_device ─► device_rows():
    the import scatters from the device rows (ImportChunk with DeviceRows), the host rows only for the others
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from deepinfer.engine import CopySlots, DeviceRows, RegisteredSlots, StagingChunk, StagingPool
from deepinfer.kvcache.shm.region import SlotRef
from deepinfer.worker.engine_loop import EngineLoop


class ChunkSlotCopies:
    """Copies a get's leased slots into one staging chunk's device rows; `positions[i]`: the chunk row of block i
    of the get."""

    def __init__(
        self, engine_loop: EngineLoop, pool: StagingPool, chunk: StagingChunk, positions: Sequence[int]
    ) -> None:
        self.engine_loop, self.pool, self.chunk = engine_loop, pool, chunk
        self.positions = list(positions)
        self.on_device: list[int] = []

    async def copy(self, region: RegisteredSlots, refs: Sequence[SlotRef], indexes: Sequence[int]) -> None:
        """Issue the copies on the engine thread and wait for their event; cancelled, still returns only once the
        copy completed (the caller's lease is released after it, and the rows may be lent again)."""
        copying = asyncio.ensure_future(self._copy(region, refs, [self.positions[i] for i in indexes]))
        try:
            await asyncio.shield(copying)
        except asyncio.CancelledError:
            await asyncio.wait([copying])
            raise

    async def _copy(self, region: RegisteredSlots, refs: Sequence[SlotRef], rows: list[int]) -> None:
        if not refs:
            return
        event = await self.engine_loop.call(
            CopySlots(self.pool, self.chunk, region.tensor, [ref.slot for ref in refs], refs[0].size, rows)
        )
        if not event.query():
            await asyncio.to_thread(event.synchronize)

    def device_rows(self, num_rows: int) -> DeviceRows | None:
        """What the import needs to know (None when nothing went to the device)."""
        if not self.on_device or self.chunk.device_rows is None:
            return None
        return DeviceRows(self.chunk.device_rows[:num_rows], tuple(self.positions[i] for i in self.on_device))
