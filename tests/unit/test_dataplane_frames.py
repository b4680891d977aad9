"""Data-plane frames, limits, checksums, error codes and secrets: pure, no sockets."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys

import msgpack
import pytest
import xxhash

from deepinfer.dataplane import (
    BlockNotFound,
    ChecksumError,
    DataPlaneError,
    DataPlaneServer,
    FrameError,
    FrameHeader,
    FrameLimits,
    FrameOp,
    FrameTooLarge,
    LayoutMismatch,
    LeaseExpired,
    check_layout,
    generate_secret,
    parse_address,
)
from deepinfer.dataplane.auth import secret_key
from deepinfer.dataplane.errors import error_from_code
from deepinfer.dataplane.frames import (
    checksum,
    decode_header,
    encode_header,
    header_length,
    payload_fields,
    read_header,
    read_payload,
    verify_checksums,
)
from deepinfer.protocol import KvHandle, KvLayout
from deepinfer.testing.dataplane import InMemoryBlockProvider

LIMITS = FrameLimits(max_header_bytes=4096, max_payload_bytes=1 << 20, max_blocks=8)


def _payloads() -> list[memoryview]:
    return [memoryview(bytes([i + 1]) * (100 + i)) for i in range(3)]


def _reply(payloads: list[memoryview]) -> FrameHeader:
    return FrameHeader(op=FrameOp.REPLY, correlation_id=7, **payload_fields(payloads))


def test_header_round_trip_keeps_every_field():
    header = FrameHeader(
        op=FrameOp.GET,
        correlation_id=42,
        request_id="req-1",
        layout_id="abcd",
        block_ids=[3, 9],
        block_hashes=[b"\x01" * 16, b"\x02" * 16],
    )
    encoded = encode_header(header, LIMITS)
    assert header_length(encoded[:4], LIMITS) == len(encoded) - 4
    assert decode_header(encoded[4:], LIMITS) == header


def test_reply_sizes_and_checksums_describe_the_payload():
    payloads = _payloads()
    reply = _reply(payloads)
    assert reply.num_blocks == 3 and reply.sizes == [100, 101, 102] and reply.payload_bytes == 303
    assert reply.checksums == [xxhash.xxh3_64_intdigest(bytes(p)) for p in payloads]


def test_checksum_is_xxh3_64():
    # Published test vector: XXH3_64bits of the empty input with seed 0.
    assert checksum(b"") == 0x2D06800538D394C2


def test_oversized_length_prefix_is_refused():
    with pytest.raises(FrameTooLarge, match="4097"):
        header_length(struct.pack(">I", 4097), LIMITS)
    assert header_length(struct.pack(">I", 4096), LIMITS) == 4096


async def test_read_header_refuses_before_reading_the_announced_bytes():
    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack(">I", 0xFFFFFFF0))  # 4 GiB announced, nothing follows
    with pytest.raises(FrameTooLarge):
        await asyncio.wait_for(read_header(reader, LIMITS), timeout=1)


async def test_read_header_and_payload_from_a_stream():
    payloads = _payloads()
    reader = asyncio.StreamReader()
    reader.feed_data(encode_header(_reply(payloads), LIMITS) + b"".join(bytes(p) for p in payloads))
    header = await read_header(reader, LIMITS)
    blocks = await read_payload(reader, header)
    assert blocks == [bytes(p) for p in payloads]
    verify_checksums(blocks, header, ["a", "b", "c"])


def test_payload_over_the_limit_is_refused():
    header = FrameHeader(
        op=FrameOp.REPLY, correlation_id=1, num_blocks=2, sizes=[1 << 19, (1 << 19) + 1], checksums=[0, 0]
    )
    with pytest.raises(FrameTooLarge, match="payload"):
        decode_header(header.to_bytes(), LIMITS)
    with pytest.raises(FrameTooLarge):
        encode_header(header, LIMITS)


def test_too_many_blocks_is_refused():
    header = FrameHeader(op=FrameOp.GET, correlation_id=1, block_ids=list(range(9)))
    with pytest.raises(FrameTooLarge, match="9 blocks"):
        decode_header(header.to_bytes(), LIMITS)


def test_header_over_max_header_bytes_is_not_sent():
    header = FrameHeader(op=FrameOp.ERROR, correlation_id=1, error_message="x" * 5000)
    with pytest.raises(FrameTooLarge, match="header"):
        encode_header(header, LIMITS)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1not msgpack",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": "1.0", "op": "steal", "correlation_id": 1}),
        msgpack.packb({"v": "9.0", "op": "get", "correlation_id": 1}),
        msgpack.packb(
            {"v": "1.0", "op": "reply", "correlation_id": 1, "num_blocks": 2, "sizes": [1], "checksums": [1]}
        ),
        msgpack.packb(
            {"v": "1.0", "op": "reply", "correlation_id": 1, "num_blocks": 1, "sizes": [-1], "checksums": [1]}
        ),
        msgpack.packb(
            {"v": "1.0", "op": "reply", "correlation_id": 1, "num_blocks": 1, "sizes": [1], "checksums": [-1]}
        ),
        msgpack.packb({"v": "1.0", "op": "get", "correlation_id": 1, "block_hashes": [b"short"]}),
    ],
    ids=[
        "garbage",
        "not-a-map",
        "unknown-op",
        "newer-major",
        "counts",
        "negative-size",
        "bad-checksum",
        "bad-hash",
    ],
)
def test_malformed_headers_are_frame_errors(raw: bytes):
    with pytest.raises(FrameError):
        decode_header(raw, LIMITS)


def test_unknown_header_fields_are_ignored():
    raw = msgpack.packb({"v": "1.3", "op": "has", "correlation_id": 5, "future_field": [1, 2]})
    assert decode_header(raw, LIMITS).correlation_id == 5


def test_checksum_mismatch_names_the_block():
    payloads = _payloads()
    header = _reply(payloads)
    blocks = [bytes(p) for p in payloads]
    blocks[1] = blocks[1][:50] + bytes([blocks[1][50] ^ 0x01]) + blocks[1][51:]
    with pytest.raises(ChecksumError, match=r"block id 12 \(#1 of 3\)"):
        verify_checksums(blocks, header, ["id 11", "id 12", "id 13"])


@pytest.mark.parametrize("cls", [LeaseExpired, BlockNotFound, ChecksumError, FrameTooLarge, FrameError])
def test_error_codes_round_trip_to_the_same_class(cls: type[DataPlaneError]):
    err = error_from_code(cls.code, "the server's words")
    assert type(err) is cls and str(err) == "the server's words"


def test_unknown_error_code_is_a_plain_data_plane_error():
    err = error_from_code("internal", "ValueError: boom")
    assert type(err) is DataPlaneError and "boom" in str(err)


def test_parse_address():
    assert parse_address("127.0.0.1:5555") == ("127.0.0.1", 5555)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("nohost", ":80", "host:", "host:http"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_secrets():
    assert len(generate_secret()) == 64 and generate_secret() != generate_secret()
    assert secret_key("a" * 16) == b"a" * 16 and secret_key(None) == b""
    with pytest.raises(ValueError, match="at least 16"):
        secret_key("short")


def test_server_without_secret_refuses_unless_insecure_is_allowed():
    with pytest.raises(ValueError, match="secret"):
        DataPlaneServer(InMemoryBlockProvider())
    DataPlaneServer(InMemoryBlockProvider(), allow_insecure=True)  # explicit opt-in builds


def test_frame_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_blocks"):
        FrameLimits(max_blocks=0)


def _handle(layout: KvLayout) -> KvHandle:
    return KvHandle(
        request_id="r1",
        block_hashes=[b"\x05" * 16],
        block_ids=[4],
        num_tokens=16,
        owner_worker_id="prefill-0",
        data_plane_address="127.0.0.1:1",
        layout=layout,
        layout_id=layout.layout_id(),
        lease_expires_at_unix_s=0.0,
    )


def test_check_layout():
    ours = KvLayout(dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64)
    check_layout(_handle(ours.model_copy()), ours)
    theirs = ours.model_copy(update={"dtype": "float16"})
    with pytest.raises(LayoutMismatch, match="float16") as info:
        check_layout(_handle(theirs), ours)
    assert ours.layout_id() in str(info.value) and theirs.layout_id() in str(info.value)


def test_the_data_plane_imports_without_torch():
    # The kvcache store and the gateway side use the data plane; neither may pull torch in.
    code = (
        "import sys\nsys.modules['torch'] = None\n"
        "import deepinfer.dataplane, deepinfer.testing.dataplane\n"
        "assert sys.modules.get('torch') is None\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
