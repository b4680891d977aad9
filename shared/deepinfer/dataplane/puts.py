"""PutPipeline: a put's blocks go to the provider while the rest of its frame is still arriving.

    socket ─► block i lands ─► checksum ─► queued ─┐
                                                    ├─► one provider call at a time takes every block queued so far
    socket ─► block i+1 lands ...                  ─┘    (on a worker thread for a plain provider: the store's
                                                         append to its segment runs beside the next receive)
    frame complete ─► the last call finishes ─► reply: REPLY when every block was written, else the first error

Only for providers that say `incremental_writes = True` (the kvcache store): such a provider accepts one put
as several `write_blocks` calls. The calls batch themselves: a slow call (one with an fsync) finds more blocks
queued after it, so a put costs few calls when writing is the bottleneck. The reply still comes after the last
call returned, so an acknowledged put is stored exactly as when it is one call. The first block whose checksum
does not hold stops the writing there: the blocks before it (each verified) are written, the rest of the frame is
read, so the connection stays in sync, but not written, and the reply is that error (blocks are content-addressed:
a later put of the stored ones is only a use). A failed call stops the writing at once, and is the reply.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence

from deepinfer.dataplane.frames import FrameHeader, checksum_error
from deepinfer.dataplane.provider import BlockProvider, call_provider


def takes_checksums(provider: BlockProvider) -> bool:
    """The provider's write_blocks accepts the verified `checksums` (and need not compute them again)."""
    return "checksums" in inspect.signature(provider.write_blocks).parameters


class PutPipeline:
    """Writes one put frame's blocks to `provider` as they arrive; `add` each block, then `finish` (or `cancel`)."""

    def __init__(self, provider: BlockProvider, request: FrameHeader, labels: Sequence[str]) -> None:
        self.provider = provider
        self.request = request
        self.labels = labels
        self.num_calls = 0
        self._pass_checksums = takes_checksums(provider)
        self._queued: list[tuple[bytes, memoryview, int]] = []
        self._error: BaseException | None = None
        self._call_failed = False
        self._wake = asyncio.Event()
        self._last = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, index: int, block: memoryview, computed: int) -> None:
        """Block `index` of the frame has landed with checksum `computed`: queue it, or stop at a bad one."""
        if self._error is not None:
            return
        expected = self.request.checksums[index]
        if computed != expected:
            label = self.labels[index]
            self._error = checksum_error(index, self.request.num_blocks, label, computed, expected)
            return
        self._queued.append((self.request.block_hashes[index], block, computed))
        self._wake.set()

    async def finish(self) -> None:
        """After the whole frame was read: wait for the writing to end; raise the first error, if any."""
        self._last = True
        self._wake.set()
        await self._task
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """The frame was not read whole: stop (a call already running on a thread still completes)."""
        self._task.cancel()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queued and not self._call_failed:
                batch, self._queued = self._queued, []
                await self._write(batch)
            if self._last:
                return

    async def _write(self, batch: list[tuple[bytes, memoryview, int]]) -> None:
        extra = {"checksums": [c for _, _, c in batch]} if self._pass_checksums else {}
        self.num_calls += 1
        try:
            await call_provider(
                self.provider.write_blocks,
                layout_id=self.request.layout_id,
                block_hashes=[h for h, _, _ in batch],
                payloads=[b for _, b, _ in batch],
                **extra,
            )
        except Exception as exc:  # reported in the reply once the frame has been read
            self._call_failed = True
            self._error = self._error or exc


__all__ = ["PutPipeline", "takes_checksums"]
