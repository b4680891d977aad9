"""Rebuilding from the segments: walk one segment file record by record and say what is valid.

A damaged header is skipped by looking for the next magic whose header checksum holds; a payload whose checksum
fails is skipped by its (checksummed) size. A tail that does not hold one whole valid record (a write cut by a
crash, zeros after a power loss) is reported as `valid_end`: the opener truncates the file there.
"""

from __future__ import annotations

import mmap
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from deepinfer.dataplane.frames import checksum
from deepinfer.kvcache.store.records import MAGIC, RecordError, RecordHead, RecordKind, decode_head


class CorruptReason(StrEnum):
    """Why a record was dropped (the `reason` label of kvstore_corrupt_records)."""

    TRUNCATED = "truncated"  # a torn tail: the file ends inside a record
    HEADER = "header"  # a header that fails its checksum (skipped up to the next valid record)
    CHECKSUM = "checksum"  # a payload that fails its checksum


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    """A valid record found at `offset` of its segment."""

    head: RecordHead
    offset: int


@dataclass
class SegmentScan:
    """What one segment holds: valid records in file order, dropped ones by reason, where valid data ends."""

    records: list[ScannedRecord] = field(default_factory=list)
    corrupt: Counter[str] = field(default_factory=Counter)
    #: Offset just after the last record worth keeping; the bytes after it are a torn or garbage tail.
    valid_end: int = 0


def scan_segment(path: Path, verify_payloads: bool) -> SegmentScan:
    """Walk one segment; payload checksums are checked only when `verify_payloads` (headers always are)."""
    with path.open("rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return SegmentScan()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
            return _scan(mm, view, size, verify_payloads)


def _scan(mm: mmap.mmap, view: memoryview, size: int, verify_payloads: bool) -> SegmentScan:
    scan = SegmentScan()
    offset = 0
    while offset < size:
        try:
            head = decode_head(view, offset)
        except RecordError:
            resume = _next_valid_head(mm, view, offset + 1)
            if resume is None:
                break  # nothing valid follows: a torn or garbage tail
            scan.corrupt[CorruptReason.HEADER] += 1
            offset = resume
            continue
        end = offset + head.record_bytes
        if end > size:
            break  # the file ends inside this record
        payload = view[offset + head.payload_offset : end]
        if verify_payloads and head.kind == RecordKind.BLOCK and checksum(payload) != head.checksum:
            scan.corrupt[CorruptReason.CHECKSUM] += 1
            offset = scan.valid_end = end
            continue
        scan.records.append(ScannedRecord(head=head, offset=offset))
        offset = scan.valid_end = end
    if scan.valid_end < size:
        scan.corrupt[CorruptReason.TRUNCATED] += 1
    return scan


def _next_valid_head(mm: mmap.mmap, view: memoryview, start: int) -> int | None:
    """Offset of the next magic at or after `start` that opens a valid header, or None."""
    position = mm.find(MAGIC, start)
    while position != -1:
        try:
            decode_head(view, position)
            return position
        except RecordError:
            position = mm.find(MAGIC, position + 1)
    return None
