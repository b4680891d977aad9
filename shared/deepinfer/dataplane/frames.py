"""Data-plane frames: a 4-byte big-endian header length, a msgpack header, then the raw block bytes.

    +-----------+----------------------+---------------------------------------------+
    | u32 BE n  | header (n bytes,     | payload: block 0 ‖ block 1 ‖ ... (sizes[i]  |
    |           | msgpack FrameHeader) | bytes each, xxh3-64 checksums[i])           |
    +-----------+----------------------+---------------------------------------------+

Every length a peer sends is checked against FrameLimits before anything is allocated for it. Never pickle.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import xxhash
from pydantic import Field, model_validator

from deepinfer.dataplane.buffers import block_buffer
from deepinfer.dataplane.errors import ChecksumError, FrameError, FrameTooLarge
from deepinfer.dataplane.stream import BlockStream
from deepinfer.protocol.base import Message, ProtocolError
from deepinfer.protocol.types import BlockHash, NonNegativeInt, PositiveInt

#: Anything with the buffer protocol that the data plane accepts as block bytes.
BytesLike = bytes | bytearray | memoryview
#: What frames are read from: an asyncio stream (the client) or a BlockStream (the server).
FrameReader = asyncio.StreamReader | BlockStream

_LENGTH = struct.Struct(">I")
#: Bytes of the header-length prefix.
LENGTH_PREFIX_BYTES = _LENGTH.size


class FrameOp(StrEnum):
    """What a frame asks for (get / put / has; lease / release: same-host shared memory) or answers
    (reply / error)."""

    GET = "get"
    PUT = "put"
    HAS = "has"
    #: The blocks' slots in the provider's shared-memory region instead of their bytes (docs/kvstore.md).
    LEASE = "lease"
    RELEASE = "release"
    REPLY = "reply"
    ERROR = "error"


@dataclass(frozen=True)
class FrameLimits:
    """Upper bounds on what a peer may make us read; both ends enforce them on every frame."""

    max_header_bytes: int = 1 << 20
    #: Sum of the block sizes of one frame (a client splits big pulls into several requests).
    max_payload_bytes: int = 1 << 30
    max_blocks: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_payload_bytes", "max_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"FrameLimits.{name} must be positive, got {getattr(self, name)}")


class SlotGrant(Message):
    """One leased block in a shared-memory region: slot index, the seq it was written under, size, xxh3-64,
    and the digest of its (layout_id, hash) (deepinfer.kvcache.shm.region)."""

    kind = "dataplane_slot_grant"

    slot: NonNegativeInt
    seq: NonNegativeInt
    size: NonNegativeInt
    checksum: int = Field(ge=0, lt=1 << 64)
    key_digest: int = Field(ge=0, lt=1 << 64)


class LeaseVia(StrEnum):
    """How a lease's reader copies the slots: from its own mapping of the region (same host), or with a
    transfer engine from the provider's registered memory (another host; deepinfer.dataplane.transfer_engine)."""

    SHARED_MEMORY = "shm"
    TRANSFER_ENGINE = "transfer_engine"


class RemoteRegion(Message):
    """Where a lease's slots are for a transfer-engine reader: the provider's engine session and the addresses
    of its region's slot headers and slots in that process (slot i's header at headers_address + 32 i, its
    bytes at slots_address + slot_bytes i; deepinfer.kvcache.shm.region). Told only in a lease reply, on an
    authenticated connection."""

    kind = "dataplane_remote_region"

    session_id: str = Field(min_length=1)
    headers_address: PositiveInt
    slots_address: PositiveInt
    slot_bytes: PositiveInt


class FrameHeader(Message):
    """The msgpack header of one frame; the payload's block sizes and checksums ride in it."""

    kind = "dataplane_frame"

    op: FrameOp
    #: Echoed by the reply so a client can tell its answer from a stale one.
    correlation_id: NonNegativeInt
    #: The lease a `get` (or a `lease`) by block id reads under (the owner's request id); empty for the store.
    request_id: str = ""
    layout_id: str = ""
    #: Owner-local block ids (get); meaningless on any other worker.
    block_ids: list[NonNegativeInt] = Field(default_factory=list)
    block_hashes: list[BlockHash] = Field(default_factory=list)
    #: Blocks in this frame's payload; sizes and checksums have exactly this many entries.
    num_blocks: NonNegativeInt = 0
    sizes: list[NonNegativeInt] = Field(default_factory=list)
    checksums: list[int] = Field(default_factory=list)
    #: Reply to `has`: one flag per requested hash.
    present: list[bool] = Field(default_factory=list)
    error_code: str = ""
    error_message: str = ""
    #: lease: the reader's host id (a provider on another host refuses); the reply's lease id, region file and
    #: one grant per hash (or per block id: a lease of a prefill worker's held blocks under `request_id`, via a
    #: transfer engine; no region file then); release: the lease id.
    host_id: str = ""
    lease_id: str = ""
    region_path: str = ""
    slots: list[SlotGrant] = Field(default_factory=list)
    #: lease: how the reader copies (a transfer engine from another host: no host id check); the reply's
    #: remote region when it is a transfer engine.
    via: LeaseVia = LeaseVia.SHARED_MEMORY
    remote_region: RemoteRegion | None = None

    @model_validator(mode="after")
    def _counts_agree(self) -> FrameHeader:
        if not len(self.sizes) == len(self.checksums) == self.num_blocks:
            raise ValueError(
                f"num_blocks={self.num_blocks} but {len(self.sizes)} sizes and {len(self.checksums)} checksums"
            )
        if any(not 0 <= c < 1 << 64 for c in self.checksums):
            raise ValueError("checksums must be unsigned 64-bit integers")
        return self

    @property
    def payload_bytes(self) -> int:
        """Total bytes of the payload that follows this header."""
        return sum(self.sizes)


def checksum(data: BytesLike) -> int:
    """xxh3-64 of one block's bytes."""
    return xxhash.xxh3_64_intdigest(data)


def byte_view(data: BytesLike) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (bytes, bytearray, numpy or memoryview)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def check_limits(header: FrameHeader, limits: FrameLimits) -> None:
    """Refuse a header whose block counts or payload size exceed the limits (FrameTooLarge)."""
    num_listed = max(header.num_blocks, len(header.block_ids), len(header.block_hashes), len(header.present),
                     len(header.slots))
    if num_listed > limits.max_blocks:
        raise FrameTooLarge(f"frame lists {num_listed} blocks, over the limit of {limits.max_blocks}")
    if header.payload_bytes > limits.max_payload_bytes:
        raise FrameTooLarge(
            f"frame payload of {header.payload_bytes} bytes is over the limit of {limits.max_payload_bytes}"
        )


def encode_header(header: FrameHeader, limits: FrameLimits) -> bytes:
    """Length prefix + msgpack header, after checking that a peer with the same limits would accept it."""
    check_limits(header, limits)
    packed = header.to_bytes()
    if len(packed) > limits.max_header_bytes:
        raise FrameTooLarge(
            f"frame header of {len(packed)} bytes is over the limit of {limits.max_header_bytes}"
        )
    return _LENGTH.pack(len(packed)) + packed


def header_length(prefix: bytes, limits: FrameLimits) -> int:
    """Decode the length prefix; FrameTooLarge when it announces more than max_header_bytes."""
    (length,) = _LENGTH.unpack(prefix)
    if length > limits.max_header_bytes:
        raise FrameTooLarge(
            f"frame header of {length} bytes announced, over the limit of {limits.max_header_bytes}"
        )
    return length


def decode_header(data: bytes, limits: FrameLimits) -> FrameHeader:
    """Parse and bound-check a header; FrameError for anything malformed."""
    try:
        header = FrameHeader.from_bytes(data)
    except ProtocolError as exc:
        raise FrameError(f"bad frame header: {exc}") from exc
    check_limits(header, limits)
    return header


async def read_header(reader: FrameReader, limits: FrameLimits, prefix: bytes | None = None) -> FrameHeader:
    """Read one header (after its already-read length prefix, if given); nothing allocated past the limits."""
    if prefix is None:
        prefix = await reader.readexactly(LENGTH_PREFIX_BYTES)
    length = header_length(prefix, limits)
    return decode_header(await reader.readexactly(length), limits)


async def read_payload(reader: asyncio.StreamReader, header: FrameHeader) -> list[bytes]:
    """Read the header's blocks, one `readexactly` each (each block is one bytes object, no later slicing)."""
    return [await reader.readexactly(size) for size in header.sizes]


async def receive_blocks(
    stream: BlockStream, header: FrameHeader, on_block: Callable[[int, memoryview, int], None] | None = None
) -> tuple[list[memoryview], list[int]]:
    """Read the header's blocks, each straight into a fresh buffer of its own, and each one's xxh3-64.

    The checksum of a block is taken as soon as it has landed (its bytes still in the CPU's cache), then
    `on_block(index, view, checksum)` is called, before the next block is read. The buffers are uninitialised
    (nothing zeroes 2 MiB that the socket overwrites at once), their fresh pages mapped in one call
    (dataplane/buffers.py); the views are read-only and nothing writes the buffers again: whoever keeps a block may
    keep its view, uncopied.
    """
    blocks, checksums = [], []
    for index, size in enumerate(header.sizes):
        buffer = block_buffer(size)
        await stream.readinto(buffer)
        block = buffer.toreadonly()
        checksums.append(checksum(block))
        blocks.append(block)
        if on_block is not None:
            on_block(index, block, checksums[-1])
    return blocks, checksums


def verify_checksums(blocks: Sequence[BytesLike], header: FrameHeader, labels: Sequence[str]) -> None:
    """ChecksumError naming the first block whose bytes do not match its checksum."""
    check_checksums([checksum(block) for block in blocks], header, labels)


def check_checksums(actual: Sequence[int], header: FrameHeader, labels: Sequence[str]) -> None:
    """ChecksumError naming the first block whose computed checksum (`actual`) is not the one the header sent."""
    for i, (computed, expected) in enumerate(zip(actual, header.checksums, strict=True)):
        if computed != expected:
            raise checksum_error(i, len(actual), labels[i], computed, expected)


def checksum_error(index: int, num_blocks: int, label: str, computed: int, expected: int) -> ChecksumError:
    """The error for block `index` (named `label`) of a frame whose bytes do not match the sent checksum."""
    return ChecksumError(
        f"block {label} (#{index} of {num_blocks}): xxh3-64 {computed:016x} != sent {expected:016x}"
    )


def frame_buffers(
    header: FrameHeader, payloads: Sequence[memoryview], limits: FrameLimits
) -> list[BytesLike]:
    """The buffers of one frame, for write_frame: encoded header then each block, uncopied."""
    return [encode_header(header, limits), *payloads]


async def write_frame(writer: asyncio.StreamWriter | BlockStream, buffers: Sequence[BytesLike]) -> None:
    """Write one frame buffer by buffer, draining after each.

    Not `writelines`: before Python 3.12 it joins everything into one bytes (a full copy of the payload), and
    a large write into a busy transport is copied into its buffer. Writing a block once the buffer has
    drained lets the transport send straight from our memoryview.
    """
    for buffer in buffers:
        writer.write(buffer)
        await writer.drain()


def payload_fields(payloads: Sequence[memoryview]) -> dict[str, object]:
    """num_blocks, sizes and checksums for a header carrying these blocks."""
    return {
        "num_blocks": len(payloads),
        "sizes": [p.nbytes for p in payloads],
        "checksums": [checksum(p) for p in payloads],
    }
