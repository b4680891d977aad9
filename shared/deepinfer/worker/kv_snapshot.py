"""Pages of the block hashes a worker's prefix cache holds, for a scheduler rebuilding its KV index.

A request at cursor 0 cuts a snapshot on the engine thread (`EngineLoop.cut_kv_snapshot`): the hash lists (device
tier, then host tier) and the KV event seq they match, frozen. Cursors run over the device list, then the host list;
a page carries its part of each. Later pages come from that frozen copy (named by its seq), so every page of one
snapshot is cut at the same seq and events after it apply on top. The last `MAX_FROZEN` snapshots are kept for
`FROZEN_TTL_S`; a request for one that is gone gets a fresh snapshot from cursor 0 (another seq: the reader
starts over).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from deepinfer.protocol import SnapshotPage, SnapshotRequest

#: Frozen snapshots kept for readers paging them (one per scheduler replica catching up at once, roughly).
MAX_FROZEN = 4
#: Seconds a frozen snapshot is kept after it was cut.
FROZEN_TTL_S = 60.0


@dataclass(frozen=True)
class Frozen:
    """One cut: the event seq it matches and the hashes then cached."""

    seq: int
    block_hashes: list[bytes]
    cut_at_s: float
    host_block_hashes: list[bytes]

    @property
    def size(self) -> int:
        return len(self.block_hashes) + len(self.host_block_hashes)


class SnapshotPages:
    """Answers SnapshotRequests of one worker from snapshots cut by `cut` (awaited on the engine thread)."""

    def __init__(
        self,
        worker_id: str,
        epoch: str,
        cut: Callable[[], Awaitable[tuple[int, list[bytes], list[bytes]]]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self._cut = cut
        self._clock = clock
        self._frozen: dict[int, Frozen] = {}

    async def page(self, request: SnapshotRequest) -> SnapshotPage:
        """The page at request.cursor of the snapshot request.seq names, or page 0 of a fresh one."""
        self._expire()
        frozen = self._frozen.get(request.seq) if request.cursor > 0 and request.seq is not None else None
        cursor = request.cursor
        if frozen is None:
            seq, block_hashes, host_block_hashes = await self._cut()
            frozen = Frozen(seq, block_hashes, self._clock(), host_block_hashes)
            self._frozen[seq] = frozen
            while len(self._frozen) > MAX_FROZEN:
                del self._frozen[min(self._frozen, key=lambda s: self._frozen[s].cut_at_s)]
            cursor = 0
        end, num_device = cursor + request.page_size, len(frozen.block_hashes)
        return SnapshotPage(
            worker_id=self.worker_id,
            seq=frozen.seq,
            block_hashes=frozen.block_hashes[cursor:end],
            host_block_hashes=frozen.host_block_hashes[max(0, cursor - num_device) : max(0, end - num_device)],
            next_cursor=end if end < frozen.size else None,
            epoch=self.epoch,
            cursor=cursor,
        )

    def _expire(self) -> None:
        horizon_s = self._clock() - FROZEN_TTL_S
        for seq in [s for s, f in self._frozen.items() if f.cut_at_s < horizon_s]:
            del self._frozen[seq]
