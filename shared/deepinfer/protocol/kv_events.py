"""What each worker's KV cache holds: event streams and paginated snapshots for the scheduler's index."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from deepinfer.protocol.base import Message
from deepinfer.protocol.types import BlockHash, NonNegativeInt


class KvEventKind(StrEnum):
    """Change to a cache's set of blocks."""

    STORED = "stored"
    REMOVED = "removed"
    ALL_CLEARED = "all_cleared"


class KvTier(StrEnum):
    """Where a block lives on its holder."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class KvEvent(Message):
    """Blocks stored in, or removed from, one tier of a worker's cache."""

    kind = "kv_event"

    # Not `kind`: that name is Message's ClassVar naming the message type.
    event_kind: KvEventKind
    block_hashes: list[BlockHash] = Field(default_factory=list)
    #: Hash of the block before the first one here (None = the chain starts at the prompt's first block).
    parent_hash: BlockHash | None = None
    tier: KvTier = KvTier.DEVICE


class KvEventBatch(Message):
    """Events of one worker, in order; `seq` increases by one per batch so a gap triggers a snapshot."""

    kind = "kv_event_batch"

    worker_id: str
    seq: NonNegativeInt
    events: list[KvEvent] = Field(default_factory=list)
    #: Unix seconds on the worker's clock.
    ts: float
    #: The worker's boot id (2.2): seq starts again at 1 in every epoch, so a restart is not a gap.
    epoch: str = ""


#: 32768 hashes of 16 bytes (18 with the msgpack bin header) ~ 590 KiB: keeps a page under 1 MiB.
MAX_SNAPSHOT_PAGE_SIZE = 32768


class SnapshotRequest(Message):
    """Ask a worker for a page of the block hashes it holds, starting at `cursor`."""

    kind = "snapshot_request"

    cursor: NonNegativeInt = 0
    #: With cursor > 0: the seq of the snapshot being paged (its first page's); a worker that no longer holds
    #: that snapshot answers with a fresh one from cursor 0 (another seq), and the reader starts over.
    seq: NonNegativeInt | None = None
    # Bounded so that a reply stays well under NATS' 1 MiB default payload limit.
    page_size: int = Field(8192, ge=1, le=MAX_SNAPSHOT_PAGE_SIZE)


class SnapshotPage(Message):
    """One page of a worker's held block hashes (payload kept < 1 MiB)."""

    kind = "snapshot_page"

    worker_id: str
    #: The worker's kv_events seq when the page was cut; events after it apply on top.
    seq: NonNegativeInt
    block_hashes: list[BlockHash] = Field(default_factory=list)
    #: Blocks of this page held in the worker's host-memory tier only (2.6); a block in both tiers is listed
    #: in both (the page's cursor range covers the device list, then the host list).
    host_block_hashes: list[BlockHash] = Field(default_factory=list)
    #: None = last page.
    next_cursor: NonNegativeInt | None = None
    #: The worker's boot id (2.2), as in its KvEventBatch.
    epoch: str = ""
    #: Where cursor pointed in the snapshot (0 on a fresh one).
    cursor: NonNegativeInt = 0
