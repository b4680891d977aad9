"""The on-disk record: a fixed 40-byte header, the key, then the payload. Little-endian throughout.

    offset  size  field
         0     4  magic b"DIKV"
         4     1  format version (1)
         5     1  kind: 1 = block, 2 = touch (a use of a block, no payload)
         6     1  L = bytes of layout_id (utf-8)
         7     1  H = bytes of block_hash
         8     8  payload size in bytes (0 for a touch)
        16     8  xxh3-64 of the payload (the data plane's checksum)
        24     8  ts: f64 wall-clock seconds of the block's last use when the record was written
        32     8  xxh3-64 of bytes 0..32 ‖ layout_id ‖ block_hash (the header checksum)
        40     L  layout_id
      40+L     H  block_hash
    40+L+H     n  payload

The header checksum makes a record boundary self-evident: after a damaged header the scanner looks for the next
magic whose header checksum holds (a random match has odds of 2^-64), so one bad byte loses one record.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import xxhash

from deepinfer.dataplane.frames import BytesLike, checksum

MAGIC = b"DIKV"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sBBBBQQd")
_HEADER_CHECKSUM = struct.Struct("<Q")
#: Bytes of the fixed header (before the key).
HEADER_BYTES = _HEAD.size + _HEADER_CHECKSUM.size
#: layout_id and block_hash are length-prefixed by one byte each.
MAX_KEY_PART_BYTES = 255
_EMPTY_CHECKSUM = checksum(b"")


class RecordKind(IntEnum):
    """What a record holds."""

    BLOCK = 1
    TOUCH = 2


class RecordError(ValueError):
    """Bytes that are not a valid record header (bad magic, version or header checksum, or cut short)."""


@dataclass(frozen=True, slots=True)
class RecordHead:
    """A decoded header and its key; offsets are relative to the record's start."""

    kind: RecordKind
    layout_id: str
    block_hash: bytes
    size_bytes: int
    checksum: int
    ts: float

    @property
    def payload_offset(self) -> int:
        """Where the payload starts, from the record's first byte."""
        return HEADER_BYTES + len(self.layout_id.encode()) + len(self.block_hash)

    @property
    def record_bytes(self) -> int:
        """Header + key + payload."""
        return self.payload_offset + self.size_bytes


def block_head(
    layout_id: str, block_hash: bytes, payload: BytesLike, ts: float, payload_checksum: int | None = None
) -> RecordHead:
    """The head of a block record for `payload`; its checksum computed here unless the caller has it already."""
    if payload_checksum is None:
        payload_checksum = checksum(payload)
    return RecordHead(
        RecordKind.BLOCK, layout_id, bytes(block_hash), memoryview(payload).nbytes, payload_checksum, ts
    )


def touch_head(layout_id: str, block_hash: bytes, ts: float) -> RecordHead:
    """The head of a touch record: block `block_hash` was used at `ts`."""
    return RecordHead(RecordKind.TOUCH, layout_id, bytes(block_hash), 0, _EMPTY_CHECKSUM, ts)


def record_bytes(key: tuple[str, bytes], payload: BytesLike) -> int:
    """Bytes of the block record of `payload` under `key` = (layout_id, block_hash)."""
    return HEADER_BYTES + len(key[0].encode()) + len(key[1]) + memoryview(payload).nbytes


def encode_head(head: RecordHead) -> bytes:
    """Header + key of one record; its payload (none for a touch) is written after it, uncopied."""
    layout = head.layout_id.encode()
    if not 0 < len(layout) <= MAX_KEY_PART_BYTES or not 0 < len(head.block_hash) <= MAX_KEY_PART_BYTES:
        raise ValueError(
            f"layout_id and block_hash must be 1..{MAX_KEY_PART_BYTES} bytes, "
            f"got {len(layout)} and {len(head.block_hash)}"
        )
    fixed = _HEAD.pack(
        MAGIC,
        FORMAT_VERSION,
        head.kind,
        len(layout),
        len(head.block_hash),
        head.size_bytes,
        head.checksum,
        head.ts,
    )
    key = layout + head.block_hash
    return fixed + _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(fixed + key)) + key


def decode_head(data: memoryview, offset: int) -> RecordHead:
    """The record header at `offset` of `data`; RecordError unless all of it is there and its checksum holds."""
    end_fixed = offset + HEADER_BYTES
    if end_fixed > len(data):
        raise RecordError(f"header cut short at {offset}")
    magic, version, kind, layout_len, hash_len, size, payload_checksum, ts = _HEAD.unpack_from(data, offset)
    if magic != MAGIC:
        raise RecordError(f"bad magic at {offset}")
    if version != FORMAT_VERSION or kind not in (RecordKind.BLOCK, RecordKind.TOUCH):
        raise RecordError(f"unknown format version {version} or kind {kind} at {offset}")
    key_end = end_fixed + layout_len + hash_len
    if key_end > len(data):
        raise RecordError(f"key cut short at {offset}")
    (expected,) = _HEADER_CHECKSUM.unpack_from(data, offset + _HEAD.size)
    digest = xxhash.xxh3_64()
    digest.update(data[offset : offset + _HEAD.size])
    digest.update(data[end_fixed:key_end])
    if digest.intdigest() != expected:
        raise RecordError(f"header checksum mismatch at {offset}")
    try:
        layout_id = bytes(data[end_fixed : end_fixed + layout_len]).decode()
    except UnicodeDecodeError as exc:  # unreachable unless a writer put bad utf-8 under a valid checksum
        raise RecordError(f"layout_id is not utf-8 at {offset}") from exc
    return RecordHead(
        kind=RecordKind(kind),
        layout_id=layout_id,
        block_hash=bytes(data[end_fixed + layout_len : key_end]),
        size_bytes=size,
        checksum=payload_checksum,
        ts=ts,
    )
