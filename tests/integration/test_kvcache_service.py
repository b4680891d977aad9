"""A kvcache shard as its own process on a real nats-server: heartbeats, lookups, puts and gets on the data
plane, the event stream; kill -9 and a restart serve every acknowledged block again, with valid checksums, and
a damaged record is reported missing, never served."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import subjects
from deepinfer.dataplane import BlockNotFound, DataPlaneClient
from deepinfer.protocol import KvLookupReply, KvLookupRequest, KvStoreEventBatch, KvStoreHeartbeat

pytestmark = pytest.mark.integration

SECRET = "s" * 32
LAYOUT = "layout-a"
HASHES = [bytes([i]) * 16 for i in range(1, 4)]
PAYLOADS = [os.urandom(64 * 1024) for _ in HASHES]


def start_shard(nats_server, data_dir: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "DEEPINFER_NATS_URL": nats_server.url, "DEEPINFER_NATS_TOKEN": nats_server.token,
           "DEEPINFER_DATA_PLANE_SECRET": SECRET, "DEEPINFER_DATA_DIR": str(data_dir),
           "DEEPINFER_KVCACHE_INTERNAL_PORT": "0", "DEEPINFER_KVCACHE_DATA_PLANE_PORT": "0",
           "DEEPINFER_KVCACHE_SHARD": "t1", "DEEPINFER_KVCACHE_MAINTENANCE_INTERVAL_S": "0.2",
           "DEEPINFER_KVCACHE_HEARTBEAT_INTERVAL_S": "0.2", "DEEPINFER_LOG_FORMAT": "text"}
    return subprocess.Popen([sys.executable, "-m", "services.kvcache"], env=env, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT)


async def next_heartbeat(bus, log: Path, timeout_s: float = 60.0) -> KvStoreHeartbeat:
    beats: asyncio.Queue[KvStoreHeartbeat] = asyncio.Queue()

    async def on_beat(beat: KvStoreHeartbeat, msg) -> None:
        beats.put_nowait(beat)

    sub = await bus.subscribe(subjects.kvcache_heartbeat("t1"), on_beat, message_type=KvStoreHeartbeat)
    try:
        return await asyncio.wait_for(beats.get(), timeout_s)
    except TimeoutError:
        pytest.fail(f"no heartbeat from the shard; its log:\n{log.read_text()[-3000:]}")
    finally:
        await sub.unsubscribe()


async def test_shard_serves_announces_and_survives_kill_9(nats_server, bus, tmp_path: Path):
    data_dir, log = tmp_path / "data", tmp_path / "kvcache.log"
    events: list[KvStoreEventBatch] = []

    async def on_events(batch: KvStoreEventBatch, msg) -> None:
        events.append(batch)

    await bus.subscribe(subjects.kvcache_events_all(), on_events, message_type=KvStoreEventBatch)
    shard = start_shard(nats_server, data_dir, log)
    try:
        beat = await next_heartbeat(bus, log)
        async with DataPlaneClient(beat.data_plane_address, SECRET) as client:
            await client.put_blocks(LAYOUT, HASHES, PAYLOADS)
            assert await client.get_blocks("", [], block_hashes=HASHES, layout_id=LAYOUT) == PAYLOADS
        reply = await bus.request(subjects.kvcache_lookup("t1"), KvLookupRequest(
            layout_id=LAYOUT, block_hashes=[*HASHES, b"\x09" * 16]), KvLookupReply, timeout_s=5)
        assert reply.present == [True, True, True, False]
        for _ in range(50):  # the maintenance loop publishes what was stored
            if events:
                break
            await asyncio.sleep(0.1)
        assert [(b.shard, b.layout_id, b.stored_block_hashes) for b in events] == [("t1", LAYOUT, HASHES)]
        assert (await next_heartbeat(bus, log)).num_blocks == 3

        shard.send_signal(signal.SIGKILL)  # after the put was acknowledged: on disk (the page cache) already
        shard.wait(10)
        shard = start_shard(nats_server, data_dir, log)
        beat = await next_heartbeat(bus, log)
        assert beat.num_blocks == 3 and beat.disk_bytes > 3 * 64 * 1024  # the index and its byte count came back
        async with DataPlaneClient(beat.data_plane_address, SECRET) as client:  # the client checks checksums
            assert await client.get_blocks("", [], block_hashes=HASHES, layout_id=LAYOUT) == PAYLOADS

        shard.send_signal(signal.SIGKILL)
        shard.wait(10)
        (segment,) = sorted((data_dir / "kvcache" / "t1").glob("*.seg"))
        raw = bytearray(segment.read_bytes())
        raw[-1] ^= 0xFF  # the last byte belongs to the last block's payload
        segment.write_bytes(bytes(raw))
        shard = start_shard(nats_server, data_dir, log)
        beat = await next_heartbeat(bus, log)
        async with DataPlaneClient(beat.data_plane_address, SECRET) as client:
            assert await client.has_blocks(LAYOUT, HASHES) == [True, True, False]
            assert await client.get_blocks("", [], block_hashes=HASHES[:2], layout_id=LAYOUT) == PAYLOADS[:2]
            with pytest.raises(BlockNotFound):
                await client.get_blocks("", [], block_hashes=HASHES[2:], layout_id=LAYOUT)
    finally:
        shard.send_signal(signal.SIGTERM)
        assert shard.wait(30) == 0, log.read_text()[-3000:]


async def test_a_second_shard_on_the_same_directory_exits_as_a_configuration_error(nats_server, bus, tmp_path):
    data_dir, log = tmp_path / "data", tmp_path / "kvcache.log"
    first = start_shard(nats_server, data_dir, log)
    try:
        await next_heartbeat(bus, log)
        second = start_shard(nats_server, data_dir, tmp_path / "second.log")
        assert second.wait(60) == 2  # deepinfer up's supervisor does not restart a configuration error
        assert "DEEPINFER_KVCACHE_DISK_DIR" in (tmp_path / "second.log").read_text()
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
