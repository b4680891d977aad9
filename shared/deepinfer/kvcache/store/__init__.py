"""The kvcache store's storage engine: immutable KV blocks by (layout_id, block_hash), RAM then disk, TTL since use.

Torch-free; served on the data plane as a `BlockProvider` (get / put / has, many blocks per round trip). The
decisions, each written out in docs/kvstore.md:

- Keys are (layout_id, block_hash): a block put under one layout is never returned for another. Blocks are
  immutable: a put of a held key only counts as a use.
- Write-through: `write_blocks` appends every new block to the active segment before it returns, then holds it in
  RAM too, so with a disk tier RAM is a subset of the disk and a kill -9 loses nothing that `write_blocks`
  returned for (the page cache survives a process). What an OS crash or power loss loses is the fsync policy's
  (`FsyncPolicy`, default `none`: the blocks the kernel had not written back; a cache can recompute them).
- Disk: append-only segment files of records (a checksummed header, the key, the payload and its xxh3-64, the
  data plane's checksum). No separate index file: the index is rebuilt from the segments on open, so it cannot be
  lost or disagree with them, and the byte counts after a restart are those of the files. A torn tail is cut
  off, a bad header skipped to the next valid one, a bad payload dropped; each is logged and counted, never
  served. Payloads are also verified on every disk read.
- Retention: a block expires `ttl_s` (72 h) after its last get or put. Uses reach the disk as small touch records,
  at most one per block per `touch_interval_s`: after a restart a block is at most that much older than the
  truth (it may expire early by that much, never late). `has` is a probe, not a use.
- Capacity: LRU by bytes in each tier (RAM: payload bytes; disk: live record bytes). Evicted and expired records
  become dead bytes that compaction (bounded steps the owner drives) reclaims by rewriting segments whose live
  fraction is low, or any with dead bytes while the files exceed disk_bytes.
- Events: stored / expired / evicted, store-level, drained by the owner with `take_events`.
"""

from deepinfer.kvcache.store.compaction import CompactionProgress
from deepinfer.kvcache.store.events import StoreEvent, StoreEventKind
from deepinfer.kvcache.store.metrics import StoreMetrics, Tier
from deepinfer.kvcache.store.scan import CorruptReason
from deepinfer.kvcache.store.segments import StoreLockedError
from deepinfer.kvcache.store.settings import FsyncPolicy, StoreSettings
from deepinfer.kvcache.store.store import KvStore, StoreStats

__all__ = [
    "CompactionProgress",
    "CorruptReason",
    "FsyncPolicy",
    "KvStore",
    "StoreEvent",
    "StoreEventKind",
    "StoreLockedError",
    "StoreMetrics",
    "StoreSettings",
    "StoreStats",
    "Tier",
]
