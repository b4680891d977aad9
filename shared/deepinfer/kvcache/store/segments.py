"""The segment files of one directory: an exclusive lock, appends to the one active segment, reads by offset.

    disk_dir/
      LOCK                 flock'd by the one store that has the directory open (released by the kernel on exit)
      0000000001.seg       sealed: never written again, only read, rewritten by compaction, deleted
      0000000002.seg       ...
      0000000007.seg       active: records are appended here until the next would pass segment_bytes

A run never appends to a segment of a previous run: the first append after open starts a new segment.
Threading (the store's locks): `append`, `seal_active` and `sync` by the one writer; `read` and `retire` under the
store's state lock, so a segment is never closed under a reader; the segment table has its own small lock.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deepinfer.dataplane.frames import BytesLike
from deepinfer.kvcache.store.settings import FsyncPolicy

_SEGMENT_NAME = re.compile(r"^(\d{10})\.seg$")


class StoreLockedError(RuntimeError):
    """Another process (or store object) has this disk_dir open."""


@dataclass(eq=False)
class Segment:
    """One open segment file."""

    segment_id: int
    path: Path
    fd: int
    size_bytes: int


def segment_path(directory: Path, segment_id: int) -> Path:
    """The file of segment `segment_id`."""
    return directory / f"{segment_id:010d}.seg"


class SegmentLog:
    """Append-only segment files under `directory`; fsync as `fsync` says (FsyncPolicy)."""

    def __init__(self, directory: Path, segment_bytes: int, fsync: FsyncPolicy) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(directory)
        self._segments: dict[int, Segment] = {}
        self._active: Segment | None = None
        self._next_id = 1
        self._dirty: set[int] = set()  # segments written since their last fdatasync
        self._table_lock = threading.Lock()

    def existing(self) -> list[tuple[int, Path]]:
        """Segment files on disk, oldest first (for the opener to scan before adopting them)."""
        found = []
        for path in self.directory.iterdir():
            match = _SEGMENT_NAME.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def adopt(self, segment_id: int, valid_end: int) -> None:
        """Open a scanned segment as sealed, cutting a torn tail at `valid_end`; an empty one is deleted."""
        path = segment_path(self.directory, segment_id)
        self._next_id = max(self._next_id, segment_id + 1)
        if valid_end == 0:
            path.unlink()
            return
        fd = os.open(path, os.O_RDWR)
        if os.fstat(fd).st_size > valid_end:
            os.ftruncate(fd, valid_end)
            os.fdatasync(fd)
        with self._table_lock:
            self._segments[segment_id] = Segment(segment_id, path, fd, valid_end)

    @property
    def file_bytes(self) -> int:
        """Bytes of every segment file: what the tier takes on disk."""
        with self._table_lock:
            return sum(s.size_bytes for s in self._segments.values())

    @property
    def active_id(self) -> int | None:
        """The segment appends go to, None until the first append of this run (or after `seal_active`)."""
        return None if self._active is None else self._active.segment_id

    def sizes(self) -> dict[int, int]:
        """Bytes of each segment file by id."""
        with self._table_lock:
            return {i: s.size_bytes for i, s in self._segments.items()}

    def append(
        self, records: Sequence[tuple[bytes, BytesLike | None]], *, durable: bool = True
    ) -> list[tuple[int, int]]:
        """Append (header + key, payload or None) records; the (segment_id, offset) of each, in order.

        `durable=False` skips the policy's fsync (touch records, compaction copies, which syncs on its own): the
        records then reach stable storage with the next sync.
        """
        locations = []
        for head, payload in records:
            buffers = [head] if payload is None else [head, memoryview(payload).cast("B")]
            record_bytes = sum(len(b) for b in buffers)
            segment = self._segment_for(record_bytes)
            _write_record(segment, buffers)
            locations.append((segment.segment_id, segment.size_bytes))
            with self._table_lock:
                segment.size_bytes += record_bytes
            self._dirty.add(segment.segment_id)
            if durable and self.fsync == FsyncPolicy.ALWAYS:
                self._sync_dirty()
        if durable and self.fsync == FsyncPolicy.BATCH:
            self._sync_dirty()
        return locations

    def read(self, segment_id: int, offset: int, size_bytes: int) -> bytes:
        """`size_bytes` bytes at `offset` of a segment; OSError when the file is shorter."""
        with self._table_lock:
            segment = self._segments[segment_id]
        data = os.pread(segment.fd, size_bytes, offset)
        if len(data) != size_bytes:
            raise OSError(f"{segment.path}: read {len(data)} of {size_bytes} bytes at {offset}")
        return data

    def seal_active(self) -> None:
        """Stop appending to the active segment; the next append starts a new one."""
        self._active = None

    def sync(self) -> None:
        """fdatasync every segment written since its last sync (whatever the policy)."""
        self._sync_dirty()

    def retire(self, segment_id: int) -> None:
        """Close and delete a sealed segment (compaction moved its live records elsewhere)."""
        if self.active_id == segment_id:
            raise ValueError(f"segment {segment_id} is active; seal it before retiring it")
        with self._table_lock:
            segment = self._segments.pop(segment_id)
        self._dirty.discard(segment_id)
        os.close(segment.fd)
        segment.path.unlink()

    def close(self) -> None:
        """Sync, close every file and release the directory lock."""
        self._sync_dirty()
        with self._table_lock:
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            os.close(segment.fd)
        self._active = None
        os.close(self._lock_fd)  # releases the flock

    def _segment_for(self, record_bytes: int) -> Segment:
        active = self._active
        if active is not None and active.size_bytes + record_bytes <= self.segment_bytes:
            return active
        if active is not None and active.size_bytes == 0:
            return active  # a record bigger than segment_bytes gets a segment of its own
        return self._roll()

    def _roll(self) -> Segment:
        segment_id, self._next_id = self._next_id, self._next_id + 1
        path = segment_path(self.directory, segment_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        if self.fsync != FsyncPolicy.NONE:
            _sync_directory(self.directory)  # the new name itself survives a power loss
        segment = Segment(segment_id, path, fd, 0)
        with self._table_lock:
            self._segments[segment_id] = segment
        self._active = segment
        return segment

    def _sync_dirty(self) -> None:
        with self._table_lock:
            segments = [self._segments[i] for i in self._dirty if i in self._segments]
        for segment in segments:
            os.fdatasync(segment.fd)
        self._dirty.clear()


def _write_record(segment: Segment, buffers: list[BytesLike]) -> None:
    """Write one whole record at the end of `segment`; on failure cut the file back to where it started."""
    try:
        remaining = [memoryview(b) for b in buffers]
        while remaining:
            written = os.writev(segment.fd, remaining)
            while remaining and written >= remaining[0].nbytes:
                written -= remaining[0].nbytes
                remaining.pop(0)
            if remaining and written:
                remaining[0] = remaining[0][written:]
    except BaseException:
        os.ftruncate(segment.fd, segment.size_bytes)  # never leave half a record behind a later one
        raise


def _lock_directory(directory: Path) -> int:
    fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLockedError(f"{directory} is open by another kvcache store") from None
    return fd


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
