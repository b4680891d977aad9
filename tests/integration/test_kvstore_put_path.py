"""The put path into a KvStore over real sockets on 127.0.0.1, at its edges: a frame trickled in tiny pieces, a block
corrupted in flight, a connection cut mid-frame, an oversized frame; every acknowledged block survives a restart."""

from __future__ import annotations

import asyncio
import struct

import pytest

from deepinfer.dataplane import ChecksumError, DataPlaneClient, DataPlaneServer, FrameHeader, FrameOp
from deepinfer.dataplane.auth import client_handshake, secret_key
from deepinfer.dataplane.frames import FrameLimits, encode_header, payload_fields, read_header
from deepinfer.kvcache.store import KvStore, StoreSettings
from tests.kvstore_harness import LAYOUT, MiB, hashes, payload

pytestmark = pytest.mark.integration

SECRET = "put-path-test-secret-0123456789"
NAMES = [f"block-{i}" for i in range(6)]


@pytest.fixture
def settings(tmp_path) -> StoreSettings:
    return StoreSettings(ram_bytes=64 * MiB, disk_dir=tmp_path / "store", disk_bytes=256 * MiB, fsync="batch")


async def _serve(store: KvStore, limits: FrameLimits | None = None) -> DataPlaneServer:
    server = DataPlaneServer(store, secret=SECRET, limits=limits)
    await server.start()
    return server


async def _raw_connection(server: DataPlaneServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    await client_handshake(reader, writer, secret_key(SECRET))
    return reader, writer


def _put_frame(names: list[str], blocks: list[bytes], correlation_id: int = 5) -> bytes:
    header = FrameHeader(
        op=FrameOp.PUT,
        correlation_id=correlation_id,
        layout_id=LAYOUT,
        block_hashes=hashes(*names),
        **payload_fields([memoryview(b) for b in blocks]),
    )
    return encode_header(header, FrameLimits()) + b"".join(blocks)


async def test_a_put_trickled_in_tiny_pieces_is_stored_whole(settings):
    blocks = [payload(n, 40_000 + i) for i, n in enumerate(NAMES[:3])]
    frame = _put_frame(NAMES[:3], blocks)
    with KvStore(settings) as store:
        server = await _serve(store)
        reader, writer = await _raw_connection(server)
        offset, step = 0, 1
        while offset < len(frame):  # 1, 2, 3, ... bytes per write: the frame lands in hundreds of receives
            writer.write(frame[offset : offset + step])
            await writer.drain()
            await asyncio.sleep(0)
            offset, step = offset + step, step % 997 + 1
        reply = await asyncio.wait_for(read_header(reader, server.limits), timeout=10)
        writer.close()
        assert reply.op == FrameOp.REPLY and reply.correlation_id == 5
        assert store.read_blocks("", [], hashes(*NAMES[:3]), LAYOUT) == blocks
        await server.close(drain_timeout_s=5)


async def test_a_block_corrupted_in_flight_is_refused_and_nothing_from_it_on_is_stored(settings):
    blocks = [payload(n, 1 * MiB) for n in NAMES]
    frame = bytearray(_put_frame(NAMES, blocks))
    header_end = len(frame) - 6 * MiB
    frame[header_end + 3 * MiB + 17] ^= 0x01  # block 3 of 6
    with KvStore(settings) as store:
        server = await _serve(store)
        reader, writer = await _raw_connection(server)
        writer.write(frame)
        await writer.drain()
        reply = await asyncio.wait_for(read_header(reader, server.limits), timeout=10)
        assert reply.op == FrameOp.ERROR and reply.error_code == ChecksumError.code
        assert f"hash {hashes(NAMES[3])[0].hex()} (#3 of 6)" in reply.error_message
        # Blocks 0..2 were verified one by one and written as they came; nothing from block 3 on was.
        assert store.has_blocks(LAYOUT, hashes(*NAMES)) == [True] * 3 + [False] * 3
        # The whole frame was read: the same connection takes the next put.
        writer.write(_put_frame(NAMES[3:], blocks[3:], correlation_id=6))
        await writer.drain()
        reply = await asyncio.wait_for(read_header(reader, server.limits), timeout=10)
        assert reply.op == FrameOp.REPLY and reply.correlation_id == 6
        writer.close()
        assert store.read_blocks("", [], hashes(*NAMES[3:]), LAYOUT) == blocks[3:]
        await server.close(drain_timeout_s=5)


async def test_a_connection_cut_mid_frame_stores_no_partial_block_and_the_server_carries_on(settings):
    blocks = [payload(n, 1 * MiB) for n in NAMES[:4]]
    frame = _put_frame(NAMES[:4], blocks)
    with KvStore(settings) as store:
        server = await _serve(store)
        reader, writer = await _raw_connection(server)
        writer.write(frame[: len(frame) - 2 * MiB - 1000])  # cut inside block 2
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        for _ in range(100):
            if not server._connections:
                break
            await asyncio.sleep(0.02)
        assert store.has_blocks(LAYOUT, hashes(*NAMES[2:4])) == [False, False]
        async with DataPlaneClient(server.address, SECRET, timeout_s=10) as client:
            await client.put_blocks(LAYOUT, hashes(*NAMES[:4]), blocks)
            assert await client.get_blocks("", block_hashes=hashes(*NAMES[:4]), layout_id=LAYOUT) == blocks
        await server.close(drain_timeout_s=5)


async def test_an_oversized_put_is_refused_before_its_payload_is_read(settings):
    limits = FrameLimits(max_payload_bytes=2 * MiB)
    with KvStore(settings) as store:
        server = await _serve(store, limits)
        reader, writer = await _raw_connection(server)
        header = FrameHeader(
            op=FrameOp.PUT, correlation_id=3, layout_id=LAYOUT, block_hashes=hashes("a"),
            num_blocks=1, sizes=[3 * MiB], checksums=[0],
        )
        packed = header.to_bytes()
        writer.write(struct.pack(">I", len(packed)) + packed)
        await writer.drain()
        reply = await asyncio.wait_for(read_header(reader, server.limits), timeout=5)
        assert reply.op == FrameOp.ERROR and reply.error_code == "too_large"
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""  # out of sync: the server hangs up
        writer.close()
        assert store.has_blocks(LAYOUT, hashes("a")) == [False]
        await server.close(drain_timeout_s=5)


async def test_every_acknowledged_block_of_a_pipelined_put_is_served_after_a_restart(settings):
    blocks = [payload(f"r-{i}", 2 * MiB) for i in range(24)]
    names = [f"r-{i}" for i in range(24)]
    store = KvStore(settings)
    server = await _serve(store)
    async with DataPlaneClient(server.address, SECRET, timeout_s=30) as client:
        await client.put_blocks(LAYOUT, hashes(*names), blocks)  # one frame of 48 MiB
    await server.close(drain_timeout_s=5)
    store.close()
    with KvStore(settings) as reopened:
        assert reopened.stats().num_disk_blocks == 24
        assert reopened.read_blocks("", [], hashes(*names), LAYOUT) == blocks
