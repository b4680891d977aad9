"""A shared-memory region of fixed-size block slots: the shard writes, co-located workers map it read-only.

A file under /dev/shm (a tmpfs), created by the shard with mode 0600 under an unguessable name, unlinked when the
shard closes. Little-endian, every part page-aligned (what `cudaHostRegister` and DMA want):

    offset 0              region header (one page): magic "DISHM\\x01\\0\\0", num_slots u64, slot_bytes u64,
                          data_offset u64
    offset PAGE           slot headers, num_slots x 32 bytes:  seq u64 | size u64 | checksum u64 | key_digest u64
    data_offset           slot 0 ‖ slot 1 ‖ ...  each slot_bytes (a multiple of PAGE): one block's KV for all
                          layers, contiguous (the data plane's payload bytes, docs/dataplane.md)

Seqlock per slot (one writer: the shard, under its state lock; any number of readers in other processes):

    writer:  seq += 1 (odd: being written) → copy the bytes, size, checksum, key_digest → seq += 1 (even)
    reader:  seq == leased seq? → copy out → seq still == leased seq? → xxh3-64 of the copy == checksum?

`seq` only grows while the region lives, so a slot rewritten after a lease was granted (the lease ended, the
shard restarted) fails the second check, never returns another block's or half a block's bytes. On x86 (TSO)
stores are seen in program order and loads are not reordered with loads, which is all the seqlock needs; the
checksum is the backstop on weaker memory models (the data plane's own rule: every block's xxh3-64 verified).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from deepinfer.dataplane.errors import ChecksumError, DataPlaneError
from deepinfer.dataplane.frames import BytesLike, checksum

PAGE = 4096
MAGIC = b"DISHM\x01\x00\x00"
_REGION_HEADER = struct.Struct("<8sQQQ")
#: u64 fields of one slot header.
SEQ, SIZE, CHECKSUM, KEY_DIGEST = range(4)
SLOT_HEADER_WORDS = 4


#: In a store's disk_dir: the path of its current region. A shard killed with -9 cannot unlink its region (the
#: tmpfs keeps its pages); the next store to own the directory (it holds the directory's LOCK) unlinks it.
SHM_REGION_RECORD = "SHM_REGION"
#: Every region file's name starts with this.
REGION_PREFIX = "deepinfer-kv-"


def replace_region_record(record: Path, region_path: Path | None) -> None:
    """Unlink the region a previous owner of the directory recorded (if it is still there); record ours (None:
    only the unlink, before ours is created, so the tmpfs has room for it)."""
    with contextlib.suppress(OSError):
        old = Path(record.read_text().strip())
        if old != region_path and old.name.startswith(REGION_PREFIX):
            old.unlink(missing_ok=True)
    if region_path is not None:
        tmp = record.with_suffix(".tmp")
        tmp.write_text(str(region_path))
        tmp.replace(record)


class TornRead(DataPlaneError):
    """The slot changed under the reader (rewritten, or its lease ended): use the data plane."""


def key_digest(layout_id: str, block_hash: bytes) -> int:
    """xxh3-64 of (layout_id, block_hash): a slot names the block it holds."""
    return xxhash.xxh3_64_intdigest(layout_id.encode() + b"\0" + bytes(block_hash))


def round_up(n: int, to: int = PAGE) -> int:
    """n rounded up to a multiple of `to`."""
    return -(-n // to) * to


@dataclass(frozen=True)
class RegionLayout:
    """Where things are in a region of num_slots slots of slot_bytes each."""

    num_slots: int
    slot_bytes: int

    @property
    def data_offset(self) -> int:
        return PAGE + round_up(self.num_slots * SLOT_HEADER_WORDS * 8)

    @property
    def size_bytes(self) -> int:
        return self.data_offset + self.num_slots * self.slot_bytes


@dataclass(frozen=True)
class SlotRef:
    """What a reader needs to read one leased block: its slot, the seq it was written under, its size and
    checksum, and the digest of the key it holds."""

    slot: int
    seq: int
    size: int
    checksum: int
    key_digest: int


class _Mapped:
    """A mapped region: numpy views of the slot headers and the slots."""

    def __init__(self, mapping: mmap.mmap, layout: RegionLayout, writable: bool) -> None:
        self.mapping, self.layout = mapping, layout
        self.headers = np.frombuffer(mapping, dtype="<u8", count=layout.num_slots * SLOT_HEADER_WORDS,
                                     offset=PAGE).reshape(layout.num_slots, SLOT_HEADER_WORDS)
        # slots: [num_slots, slot_bytes] uint8, slot i = one block's bytes from its start
        self.slots = np.frombuffer(mapping, dtype=np.uint8, count=layout.num_slots * layout.slot_bytes,
                                   offset=layout.data_offset).reshape(layout.num_slots, layout.slot_bytes)
        if not writable:
            self.headers.flags.writeable = False
            self.slots.flags.writeable = False

    def close(self) -> None:
        del self.headers, self.slots  # the views must go before the mapping can close
        self.mapping.close()


class SlotRegion:
    """The shard's side: creates the file, writes slots under the seqlock. Not thread-safe (one writer: the
    store's state lock serialises it).

    `directory=None`: the region is anonymous memory of this process (no file, `path` None), for a region only
    transfer engines read (a prefill worker's handoff exports, deepinfer.worker.handoff_exports)."""

    def __init__(self, directory: Path | None, num_slots: int, slot_bytes: int) -> None:
        if num_slots <= 0 or slot_bytes <= 0 or slot_bytes % PAGE:
            raise ValueError(f"a region needs num_slots > 0 and slot_bytes a positive multiple of {PAGE}, "
                             f"got {num_slots} x {slot_bytes}")
        self.layout = RegionLayout(num_slots, slot_bytes)
        self.path: Path | None = None
        if directory is None:
            mapping = mmap.mmap(-1, self.layout.size_bytes)  # MAP_SHARED | MAP_ANONYMOUS, page-aligned
        else:
            self.path = Path(directory) / f"{REGION_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
            mapping = _create_file(self.path, self.layout.size_bytes)
        mapping[:_REGION_HEADER.size] = _REGION_HEADER.pack(MAGIC, num_slots, slot_bytes, self.layout.data_offset)
        self._mapped = _Mapped(mapping, self.layout, writable=True)

    def write(self, slot: int, payload: BytesLike, digest: int, payload_checksum: int | None = None) -> SlotRef:
        """Copy one block into a slot under the seqlock; the reference a lease hands out."""
        data = np.frombuffer(payload, dtype=np.uint8)
        if data.size > self.layout.slot_bytes:
            raise ValueError(f"a block of {data.size} bytes does not fit a {self.layout.slot_bytes}-byte slot")
        sums = checksum(payload) if payload_checksum is None else payload_checksum
        header = self._mapped.headers[slot]
        seq = int(header[SEQ]) + 1
        header[SEQ] = seq  # odd: being written
        self._mapped.slots[slot, :data.size] = data
        header[SIZE], header[CHECKSUM], header[KEY_DIGEST] = data.size, sums, digest
        header[SEQ] = seq + 1
        return SlotRef(slot, seq + 1, int(data.size), sums, digest)

    @property
    def address(self) -> int:
        """The mapping's base address in this process (what a transfer engine registers: the whole region, so
        a remote reader can check a slot's header after copying its bytes)."""
        return self._mapped.headers.ctypes.data - PAGE

    def view(self, slot: int, size: int) -> memoryview:
        """The slot's first `size` bytes, read-only (valid only while the slot is not rewritten)."""
        return memoryview(self._mapped.slots[slot, :size]).toreadonly()

    def close(self) -> None:
        """Unmap and unlink: mappings workers hold stay valid (their pages live until the last unmap)."""
        self._mapped.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _create_file(path: Path, size_bytes: int) -> mmap.mmap:
    """A new mode-0600 file of size_bytes, every page reserved, mapped shared read-write."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Reserve every page now: a tmpfs that is too small (a container's 64 MiB /dev/shm) fails here with
        # ENOSPC, not later with a SIGBUS on a write into the mapping.
        os.posix_fallocate(fd, 0, size_bytes)
        return mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


class SlotReader:
    """A worker's read-only mapping of a shard's region (opened once per region path and kept)."""

    def __init__(self, path: str | Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, num_slots, slot_bytes, data_offset = _REGION_HEADER.unpack_from(mapping, 0)
        layout = RegionLayout(num_slots, slot_bytes)
        if magic != MAGIC or layout.data_offset != data_offset or layout.size_bytes != size:
            mapping.close()
            raise DataPlaneError(f"{path} is not a kv slot region this version reads")
        self.path, self.layout = Path(path), layout
        self._mapped = _Mapped(mapping, layout, writable=False)

    @property
    def slots(self) -> np.ndarray:
        """[num_slots, slot_bytes] uint8, read-only: the array the GPU path registers as pinned memory
        (`cudaHostRegister` of its base pointer, read-only flag) to copy slots to the device on its copy stream."""
        return self._mapped.slots

    def current(self, slot: int) -> SlotRef | None:
        """What the slot holds now, unleased (None while it is being written): for tests and benches; a reader
        of the store uses the SlotRef of its lease."""
        seq, size, sums, digest = (int(x) for x in self._mapped.headers[slot])
        return None if seq % 2 else SlotRef(slot, seq, size, sums, digest)

    def read_into(self, ref: SlotRef, dst: np.ndarray) -> None:
        """Copy one leased block into dst (uint8, exactly ref.size bytes), seqlock- and checksum-checked.

        Raises TornRead when the slot no longer holds the leased block, ChecksumError when the copy's xxh3-64
        is not the block's; dst then holds garbage.
        """
        self.check(ref)
        np.copyto(dst, self._mapped.slots[ref.slot, :ref.size])
        self.check(ref, "was rewritten during the copy")
        if checksum(dst) != ref.checksum:
            raise ChecksumError(f"slot {ref.slot}: checksum mismatch")

    def check(self, ref: SlotRef, what: str = "no longer holds the leased block") -> None:
        """The seqlock's test, either side of a copy: TornRead unless the slot still holds the leased block under
        the leased seq (a copy between two passing checks read exactly that block; the DMA path copies in
        between)."""
        header = self._mapped.headers[ref.slot]
        if int(header[SEQ]) != ref.seq or int(header[SIZE]) != ref.size or int(header[KEY_DIGEST]) != ref.key_digest:
            raise TornRead(f"slot {ref.slot} {what}")

    def verify(self, ref: SlotRef) -> None:
        """ChecksumError unless the slot's bytes hash to the leased checksum (read in place: the DMA path's
        optional xxh3 pass; only meaningful between two passing `check`s)."""
        if checksum(self._mapped.slots[ref.slot, :ref.size]) != ref.checksum:
            raise ChecksumError(f"slot {ref.slot}: checksum mismatch")

    def close(self) -> None:
        """Unmap."""
        self._mapped.close()
