"""Compaction: rewrite a segment's live records at the end of the log, then delete the segment.

One step, in three parts so that readers wait only for the short first and last (the store's state lock):

    plan   (state lock)  pick the victim, list up to compact_step_bytes of its live block records by offset
    copy   (write lock)  read them from the victim (checksums verified), append them with their current last
                         use as ts; on the victim's last step also rewrite its live touch records, then fsync the
                         copies (whatever the policy: a deleted segment's blocks must already be durable elsewhere)
    finish (state lock)  point the index at each copy that is still wanted; retire the victim once empty

Victim: the sealed segment (the active one is sealed first if chosen) with the lowest live fraction, among those
under `compact_live_fraction`; while the files exceed disk_bytes, any segment with dead bytes qualifies, so the
files shrink back to the live bytes. Only compaction retires segments, so the copy reads the victim unlocked.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from deepinfer.kvcache.store.disk import AppendedBlock, AppendedTouch, CorruptRecordError, DiskEntry, DiskTier
from deepinfer.kvcache.store.ram import Key


@dataclass(frozen=True)
class CompactionProgress:
    """What one step (or a whole `compact`) did; `done` when no segment qualified afterwards."""

    copied_bytes: int = 0
    reclaimed_bytes: int = 0
    done: bool = True


@dataclass
class CompactionPlan:
    """One step's work: block records to copy (key, a snapshot of its entry) and touches to rewrite."""

    victim_id: int
    blocks: list[tuple[Key, DiskEntry]]
    #: (key, last use) of the victim's live touch records; only on the victim's last step.
    touches: list[tuple[Key, float]]
    #: This step copies every live record the victim has left.
    finishing: bool


@dataclass
class CopyResult:
    """The copies written, in plan order, and the keys whose record failed its checksum on the way."""

    blocks: list[tuple[Key, int, AppendedBlock]] = field(default_factory=list)  # key, old offset, copy
    touches: list[AppendedTouch] = field(default_factory=list)
    corrupt: list[Key] = field(default_factory=list)

    @property
    def copied_bytes(self) -> int:
        """Bytes appended by this step."""
        return sum(b.head.record_bytes for _, _, b in self.blocks) + sum(t.record_bytes for t in self.touches)


def choose_victim(disk: DiskTier) -> int | None:
    """The segment compaction should rewrite next, or None."""
    sizes = disk.log.sizes()
    over_capacity = sum(sizes.values()) > disk.settings.disk_bytes
    best: tuple[float, int] | None = None
    for segment_id, size in sizes.items():
        live = disk.segment_live_bytes(segment_id)
        if size == 0 or live >= size:
            continue  # nothing dead to reclaim
        fraction = live / size
        if (fraction < disk.settings.compact_live_fraction or over_capacity) and (
            best is None or fraction < best[0]
        ):
            best = (fraction, segment_id)
    return None if best is None else best[1]


def plan_step(disk: DiskTier, max_copy_bytes: int) -> CompactionPlan | None:
    """Under the state lock: the next step's plan, or None when nothing qualifies."""
    victim_id = choose_victim(disk)
    if victim_id is None:
        return None
    if victim_id == disk.log.active_id:
        disk.log.seal_active()  # copies must land in another segment
    block_keys, touch_keys = disk.segment_members(victim_id)
    entries = sorted(((key, disk.get(key)) for key in block_keys), key=lambda item: item[1].offset)
    chosen: list[tuple[Key, DiskEntry]] = []
    total = 0
    for key, entry in entries:
        if chosen and total + entry.record_bytes > max_copy_bytes:
            break
        chosen.append((key, replace(entry)))  # a snapshot: the live entry may move on
        total += entry.record_bytes
    finishing = len(chosen) == len(entries)
    touches = [(key, disk.get(key).last_used_s) for key in touch_keys] if finishing else []
    return CompactionPlan(victim_id, chosen, touches, finishing)


def copy_step(disk: DiskTier, plan: CompactionPlan) -> CopyResult:
    """Under the write lock only: read the planned records, append their copies (and touches)."""
    result = CopyResult()
    items, offsets = [], []
    for key, entry in plan.blocks:
        try:
            payload = disk.read_payload(entry)
        except CorruptRecordError:
            result.corrupt.append(key)
            continue
        items.append((key, payload, entry.last_used_s, entry.checksum))  # just verified by read_payload
        offsets.append(entry.offset)
    appended = disk.append_blocks(items, durable=False) if items else []
    result.blocks = [(b.key, offset, b) for offset, b in zip(offsets, appended, strict=True)]
    result.touches = disk.append_touches(plan.touches) if plan.touches else []
    if plan.finishing:
        disk.log.sync()
    return result


def finish_step(disk: DiskTier, plan: CompactionPlan, copied: CopyResult) -> int:
    """Under the state lock, after the corrupt keys were dropped: repoint the index; bytes reclaimed."""
    for key, old_offset, block in copied.blocks:
        disk.move_block(key, old_offset, block, plan.victim_id)
    for touch in copied.touches:
        disk.move_touch(touch, plan.victim_id)
    block_keys, touch_keys = disk.segment_members(plan.victim_id)
    if not plan.finishing or block_keys or touch_keys:
        return 0
    reclaimed = disk.log.sizes()[plan.victim_id]
    disk.log.retire(plan.victim_id)
    disk.forget_segment(plan.victim_id)
    return reclaimed
