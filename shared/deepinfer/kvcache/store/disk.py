"""The disk tier's index: where each live block's record is, its last use, LRU order and per-segment live bytes.

    index (an OrderedDict): first = least recently used (evicted first) ... last = most recently used
    key -> DiskEntry: the block record (segment_id, offset, sizes, checksum) and, when a later use was recorded,
           the live touch record (touch_segment_id, touch_bytes)

Invariant: `_live_bytes[s]` is the bytes of the block and touch records in segment s that the index points at;
the rest of the file is dead (superseded, evicted, expired, corrupt) and compaction reclaims it. The live total
is what `disk_bytes` bounds. Built on open from the segments alone (no separate index file, so no index can be
lost or disagree with the data): the byte counts after a restart are those of the files.

Not thread-safe: index methods run under the store's state lock; `append_*` under its write lock.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from deepinfer.dataplane.frames import BytesLike, checksum
from deepinfer.kvcache.store.ram import Key
from deepinfer.kvcache.store.records import RecordHead, RecordKind, block_head, encode_head, touch_head
from deepinfer.kvcache.store.scan import ScannedRecord, scan_segment
from deepinfer.kvcache.store.segments import SegmentLog
from deepinfer.kvcache.store.settings import StoreSettings

logger = logging.getLogger(__name__)


class CorruptRecordError(Exception):
    """A record's payload no longer matches its checksum (or cannot be read whole)."""


@dataclass(slots=True)
class DiskEntry:
    """Where a live block's record is, and its use times (wall-clock seconds)."""

    segment_id: int
    offset: int
    payload_offset: int  # from the start of the segment file
    size_bytes: int  # payload only
    record_bytes: int
    checksum: int
    last_used_s: float
    #: The newest use written to disk (the block record's ts or a touch record's): a restart sees this one.
    durable_used_s: float
    touch_segment_id: int | None = None
    touch_bytes: int = 0


@dataclass
class OpenReport:
    """What rebuilding the index found."""

    num_segments: int = 0
    num_blocks: int = 0
    corrupt: Counter[str] = field(default_factory=Counter)
    num_expired: int = 0
    num_evicted: int = 0


@dataclass(frozen=True, slots=True)
class AppendedTouch:
    """A touch record written by this run: `key` was used at `ts`."""

    key: Key
    segment_id: int
    record_bytes: int
    ts: float


@dataclass(frozen=True, slots=True)
class AppendedBlock:
    """A block record written by this run, not yet in the index."""

    key: Key
    segment_id: int
    offset: int
    head: RecordHead


class DiskTier:
    """The index over a SegmentLog; LRU by live record bytes within `settings.disk_bytes`."""

    def __init__(self, settings: StoreSettings, now_s: float) -> None:
        assert settings.disk_dir is not None
        self.settings = settings
        self.log = SegmentLog(settings.disk_dir, settings.segment_bytes, settings.fsync)
        #: Bytes of the live records: what disk_bytes bounds.
        self.live_bytes = 0
        self._index: OrderedDict[Key, DiskEntry] = OrderedDict()
        self._live_by_segment: dict[int, int] = {}
        self._blocks_by_segment: dict[int, set[Key]] = {}
        self._touches_by_segment: dict[int, set[Key]] = {}
        try:
            self.open_report = self._rebuild(now_s)
        except BaseException:
            self.log.close()  # release the directory: the open failed
            raise

    # -- lookups and uses (state lock) ----------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def get(self, key: Key) -> DiskEntry | None:
        """The entry, without counting a use."""
        return self._index.get(key)

    def use(self, key: Key, now_s: float) -> bool:
        """Record a use in memory; True when a touch record is due (the durable last use is too old)."""
        entry = self._index[key]
        entry.last_used_s = max(entry.last_used_s, now_s)
        self._index.move_to_end(key)
        return entry.last_used_s - entry.durable_used_s >= self.settings.touch_interval_s

    def read_payload(self, entry: DiskEntry) -> bytes:
        """The block's payload, checksum verified; CorruptRecordError when it does not match."""
        try:
            payload = self.log.read(entry.segment_id, entry.payload_offset, entry.size_bytes)
        except OSError as exc:
            raise CorruptRecordError(str(exc)) from exc
        if checksum(payload) != entry.checksum:
            raise CorruptRecordError(
                f"segment {entry.segment_id} offset {entry.offset}: payload checksum mismatch"
            )
        return payload

    def expired(self, now_s: float) -> list[Key]:
        """Keys unused for more than ttl_s, oldest first (not removed)."""
        found = []
        for key, entry in self._index.items():
            if now_s - entry.last_used_s <= self.settings.ttl_s:
                break
            found.append(key)
        return found

    def keys(self) -> list[Key]:
        """Every live key, least recently used first."""
        return list(self._index)

    # -- changes (state lock) -------------------------------------------------------------------------------
    def insert(self, block: AppendedBlock, last_used_s: float) -> list[Key]:
        """Index a block record appended by this run; the keys evicted (LRU first) to keep within disk_bytes."""
        head = block.head
        entry = DiskEntry(
            segment_id=block.segment_id,
            offset=block.offset,
            payload_offset=block.offset + head.payload_offset,
            size_bytes=head.size_bytes,
            record_bytes=head.record_bytes,
            checksum=head.checksum,
            last_used_s=last_used_s,
            durable_used_s=head.ts,
        )
        evicted = self.make_room(entry.record_bytes)
        self._add(block.key, entry)
        return evicted

    def make_room(self, record_bytes: int) -> list[Key]:
        """Evict least recently used blocks until `record_bytes` more fit; the evicted keys, LRU first."""
        evicted = []
        while self._index and self.live_bytes + record_bytes > self.settings.disk_bytes:
            key = next(iter(self._index))
            self.remove(key)
            evicted.append(key)
        return evicted

    def remove(self, key: Key) -> bool:
        """Drop a block from the index (its records become dead bytes); False when it was not there."""
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._account_block(key, entry, -1)
        self._set_touch(key, entry, None, 0)
        return True

    def record_touch(self, touch: AppendedTouch) -> None:
        """A touch record reached the log: it replaces the key's previous one (dead if the key left meanwhile)."""
        entry = self._index.get(touch.key)
        if entry is None or touch.ts <= entry.durable_used_s:
            return
        entry.durable_used_s = touch.ts
        self._set_touch(touch.key, entry, touch.segment_id, touch.record_bytes)

    def move_block(self, key: Key, old_offset: int, block: AppendedBlock, victim_id: int) -> bool:
        """Point `key` at the copy compaction wrote; False (the copy is dead) when it left or moved meanwhile."""
        entry = self._index.get(key)
        if entry is None or entry.segment_id != victim_id or entry.offset != old_offset:
            return False
        self._account_block(key, entry, -1)
        entry.segment_id, entry.offset = block.segment_id, block.offset
        entry.payload_offset = block.offset + block.head.payload_offset
        entry.durable_used_s = max(entry.durable_used_s, block.head.ts)
        self._account_block(key, entry, +1)
        if entry.touch_segment_id is not None and entry.durable_used_s >= entry.last_used_s:
            self._set_touch(key, entry, None, 0)  # the copy's ts carries the newest use
        return True

    def move_touch(self, touch: AppendedTouch, victim_id: int) -> bool:
        """Point `key`'s live touch at the copy compaction wrote; False (the copy is dead) when it changed."""
        entry = self._index.get(touch.key)
        if entry is None or entry.touch_segment_id != victim_id:
            return False
        entry.durable_used_s = max(entry.durable_used_s, touch.ts)
        self._set_touch(touch.key, entry, touch.segment_id, touch.record_bytes)
        return True

    def segment_live_bytes(self, segment_id: int) -> int:
        """Live bytes of one segment."""
        return self._live_by_segment.get(segment_id, 0)

    def segment_members(self, segment_id: int) -> tuple[set[Key], set[Key]]:
        """Keys whose block record, and keys whose live touch record, are in this segment."""
        return (
            set(self._blocks_by_segment.get(segment_id, ())),
            set(self._touches_by_segment.get(segment_id, ())),
        )

    def forget_segment(self, segment_id: int) -> None:
        """Drop a retired segment's (empty) accounting."""
        assert not self._blocks_by_segment.get(segment_id) and not self._touches_by_segment.get(segment_id)
        for table in (self._live_by_segment, self._blocks_by_segment, self._touches_by_segment):
            table.pop(segment_id, None)

    # -- appends (write lock) -------------------------------------------------------------------------------
    def append_blocks(
        self, items: list[tuple[Key, BytesLike, float, int | None]], *, durable: bool = True
    ) -> list[AppendedBlock]:
        """Write block records (key, payload, last use, checksum or None) in order, fsync per policy unless not
        `durable`. A given checksum is trusted (the data plane verified it); None: computed here."""
        heads = [block_head(key[0], key[1], payload, ts, known) for key, payload, ts, known in items]
        records = [(encode_head(h), item[1]) for h, item in zip(heads, items, strict=True)]
        locations = self.log.append(records, durable=durable)
        return [
            AppendedBlock(item[0], segment_id, offset, head)
            for item, head, (segment_id, offset) in zip(items, heads, locations, strict=True)
        ]

    def append_touches(self, items: list[tuple[Key, float]]) -> list[AppendedTouch]:
        """Write touch records (key used at ts), never fsync'd on their own; index them with `record_touch`."""
        heads = [touch_head(key[0], key[1], ts) for key, ts in items]
        locations = self.log.append([(encode_head(h), None) for h in heads], durable=False)
        return [
            AppendedTouch(key, segment_id, head.record_bytes, head.ts)
            for (key, _), head, (segment_id, _offset) in zip(items, heads, locations, strict=True)
        ]

    def close(self) -> None:
        """Sync and close the segment files, releasing the directory."""
        self.log.close()

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def _add(self, key: Key, entry: DiskEntry) -> None:
        self._index[key] = entry
        self._account_block(key, entry, +1)

    def _account_block(self, key: Key, entry: DiskEntry, sign: int) -> None:
        members = self._blocks_by_segment.setdefault(entry.segment_id, set())
        if sign > 0:
            members.add(key)
        else:
            members.discard(key)
        self._live_by_segment[entry.segment_id] = (
            self.segment_live_bytes(entry.segment_id) + sign * entry.record_bytes
        )
        self.live_bytes += sign * entry.record_bytes

    def _set_touch(self, key: Key, entry: DiskEntry, segment_id: int | None, touch_bytes: int) -> None:
        if entry.touch_segment_id is not None:
            old = entry.touch_segment_id
            self._touches_by_segment[old].discard(key)
            self._live_by_segment[old] -= entry.touch_bytes
            self.live_bytes -= entry.touch_bytes
        entry.touch_segment_id, entry.touch_bytes = segment_id, touch_bytes
        if segment_id is not None:
            self._touches_by_segment.setdefault(segment_id, set()).add(key)
            self._live_by_segment[segment_id] = self.segment_live_bytes(segment_id) + touch_bytes
            self.live_bytes += touch_bytes

    # -- open -----------------------------------------------------------------------------------------------
    def _rebuild(self, now_s: float) -> OpenReport:
        report = OpenReport()
        blocks: dict[Key, tuple[int, ScannedRecord]] = {}  # the newest copy of each block
        touches: dict[Key, tuple[int, ScannedRecord]] = {}  # the newest use of each block
        for segment_id, path in self.log.existing():
            scan = scan_segment(path, self.settings.verify_on_open)
            for reason, count in scan.corrupt.items():
                logger.warning("kvstore: %s: dropped %d %s record(s), never served", path, count, reason)
            report.corrupt.update(scan.corrupt)
            self.log.adopt(segment_id, scan.valid_end)
            report.num_segments += scan.valid_end > 0
            for record in scan.records:
                key = (record.head.layout_id, record.head.block_hash)
                if record.head.kind == RecordKind.BLOCK:
                    blocks[key] = (segment_id, record)  # file order: a later copy supersedes
                elif key not in touches or record.head.ts >= touches[key][1].head.ts:
                    touches[key] = (segment_id, record)
        entries = [(key, *_entry_of(s, record, touches.get(key))) for key, (s, record) in blocks.items()]
        entries.sort(key=lambda item: item[1])  # LRU order: oldest last use first
        for key, last_used_s, entry, touch in entries:
            if now_s - last_used_s > self.settings.ttl_s:
                report.num_expired += 1
                continue
            self._add(key, entry)
            if touch is not None:
                self._set_touch(key, entry, touch[0], touch[1])
        report.num_evicted = len(self.make_room(0))
        report.num_blocks = len(self._index)
        logger.info(
            "kvstore: opened %s: %d blocks, %d live of %d file bytes in %d segments; dropped %d corrupt record(s), "
            "%d expired and %d over-capacity block(s)",
            self.settings.disk_dir,
            report.num_blocks,
            self.live_bytes,
            self.log.file_bytes,
            report.num_segments,
            sum(report.corrupt.values()),
            report.num_expired,
            report.num_evicted,
        )
        return report


def _entry_of(
    segment_id: int, record: ScannedRecord, touch: tuple[int, ScannedRecord] | None
) -> tuple[float, DiskEntry, tuple[int, int] | None]:
    """(last use, the entry, the live touch record's (segment_id, bytes) or None) of a scanned block."""
    head = record.head
    last_used_s = head.ts
    live_touch = None
    if touch is not None and touch[1].head.ts > head.ts:
        last_used_s = touch[1].head.ts
        live_touch = (touch[0], touch[1].head.record_bytes)
    entry = DiskEntry(
        segment_id=segment_id,
        offset=record.offset,
        payload_offset=record.offset + head.payload_offset,
        size_bytes=head.size_bytes,
        record_bytes=head.record_bytes,
        checksum=head.checksum,
        last_used_s=last_used_s,
        durable_used_s=last_used_s,
    )
    return last_used_s, entry, live_touch
