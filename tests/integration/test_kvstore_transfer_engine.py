"""Store gets through Mooncake Transfer Engine (deepinfer.kvcache.client.remote), loopback TCP, the shard in a
process of its own: byte-identical to the data-plane get; a slot rewritten after its lease ended is never served;
a peer that was never told a lease learns no session or address, and reads outside the registered region (or
after the shard closed its store) get nothing; the kvcache service's `transfer_engine` setting end to end.

Skips, saying why, without the `transfer-engine` extra or libibverbs1 (.ci/run installs both)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from deepinfer.dataplane import (
    ChecksumError,
    DataPlaneAuthError,
    DataPlaneClient,
    DataPlaneError,
    generate_secret,
)
from deepinfer.dataplane.frames import LeaseVia
from deepinfer.dataplane.transfer_engine import Transfer, TransferEngine, TransferFailed, availability
from deepinfer.kvcache.client import KvStoreClient, KvTransport
from deepinfer.kvcache.shm.region import TornRead
from deepinfer.protocol import KvStoreHeartbeat

pytestmark = pytest.mark.integration

if reason := availability():
    pytest.skip(f"transfer engine unavailable: {reason}", allow_module_level=True)

LAYOUT = "layout-te"
SLOT = 64 * 1024
SIZE = 48 * 1024
HASHES = [bytes([i]) * 16 for i in range(1, 9)]
PAYLOADS = [os.urandom(SIZE) for _ in HASHES]


def _serve_shard(conn, secret: str, num_slots: int, lease_s: float) -> None:
    """Child process: a KvStore with its RAM tier in a slot region registered with this process's transfer
    engine, behind a DataPlaneServer; sends (address, host_id, session id), closes the store on "close-store",
    exits on "stop"."""
    from deepinfer.dataplane import DataPlaneServer
    from deepinfer.kvcache.store import KvStore, StoreSettings

    async def serve() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            store = KvStore(StoreSettings(ram_bytes=num_slots * SLOT, disk_dir=Path(tmp) / "kv",
                                          shm_dir=Path("/dev/shm"), shm_slot_bytes=SLOT, shm_lease_s=lease_s))
            engine = TransferEngine.start("127.0.0.1")
            store.serve_transfer_engine(engine)
            server = DataPlaneServer(store, secret=secret)
            await server.start()
            conn.send((server.address, store.host_id, engine.session_id))
            loop = asyncio.get_running_loop()
            while (command := await loop.run_in_executor(None, conn.recv)) != "stop":
                if command == "close-store":
                    store.close()
                conn.send("ok")
            await server.close(drain_timeout_s=5)
            store.close()

    asyncio.run(serve())


class ShardProcess:
    """A shard process and the pipe that drives it."""

    def __init__(self, num_slots: int = 16, lease_s: float = 30.0) -> None:
        self.secret = generate_secret()
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve_shard, args=(child, self.secret, num_slots, lease_s), daemon=True)
        self.process.start()
        if not self.conn.poll(60):
            raise RuntimeError("the shard process did not start")
        self.address, self.host_id, self.session_id = self.conn.recv()

    def command(self, command: str) -> None:
        self.conn.send(command)
        assert self.conn.poll(30) and self.conn.recv() == "ok"

    def stop(self) -> None:
        self.conn.send("stop")
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


@pytest.fixture
def shard():
    process = ShardProcess()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def engine():
    """This process's engine: the worker side (one per process, as in a worker)."""
    return TransferEngine.shared("127.0.0.1")


def _client(shard: ShardProcess, transport: KvTransport, *, host_id: str = "") -> KvStoreClient:
    client = KvStoreClient(shard.secret, timeout_s=30, shard_lease_s=3600, host_id=host_id or shard.host_id,
                           transport=transport)
    client.shards.observe(KvStoreHeartbeat(shard="s0", data_plane_address=shard.address, internal_address="-",
                                           ts=time.time(), host_id=shard.host_id, shm=True, transfer_engine=True))
    return client


async def test_a_get_through_the_transfer_engine_matches_the_data_plane_get(shard, engine):
    te = _client(shard, KvTransport.MOONCAKE)
    plane = _client(shard, KvTransport.DATAPLANE)
    try:
        await plane.put(LAYOUT, HASHES, PAYLOADS)
        over_socket = [bytes(b) for b in await plane.get(LAYOUT, HASHES)]
        assert over_socket == PAYLOADS
        rows = np.zeros((len(HASHES), SIZE), np.uint8)  # a staging pool's rows, registered once
        te.transfer_engine.register(rows)
        into = [memoryview(row) for row in rows]
        got = await te.get(LAYOUT, HASHES, into=into)
        assert all(g is buf for g, buf in zip(got, into, strict=True))
        assert [row.tobytes() for row in rows] == over_socket
        assert engine._registered.get(rows.ctypes.data) == rows.nbytes  # registered when the engine started
        assert [bytes(b) for b in await te.get(LAYOUT, HASHES)] == over_socket  # fresh buffers, registered for the batch
        assert te.transfer_engine.num_blocks == 2 * len(HASHES) and te.transfer_engine.num_fallbacks == 0
        assert plane.transfer_engine.num_blocks == 0 and plane.shared_memory.num_blocks == 0
    finally:
        await te.close()
        await plane.close()


async def test_auto_takes_the_engine_only_for_a_shard_on_another_host(shard, engine):
    here = _client(shard, KvTransport.AUTO)
    elsewhere = _client(shard, KvTransport.AUTO, host_id="another-host/boot")
    try:
        await here.put(LAYOUT, HASHES, PAYLOADS)
        assert [bytes(b) for b in await here.get(LAYOUT, HASHES)] == PAYLOADS
        assert [bytes(b) for b in await elsewhere.get(LAYOUT, HASHES)] == PAYLOADS
        assert here.shared_memory.num_blocks == len(HASHES) and here.transfer_engine.num_blocks == 0
        assert elsewhere.transfer_engine.num_blocks == len(HASHES) and elsewhere.shared_memory.num_blocks == 0
    finally:
        await here.close()
        await elsewhere.close()


async def test_a_slot_rewritten_after_its_lease_ended_is_never_served(engine):
    shard = ShardProcess(num_slots=8, lease_s=0.5)
    client = _client(shard, KvTransport.MOONCAKE)
    try:
        await client.put(LAYOUT, HASHES, PAYLOADS)  # 8 blocks fill the 8 slots
        async with DataPlaneClient(shard.address, shard.secret) as plane:
            stale = await plane.lease_blocks(LAYOUT, HASHES, "", via=LeaseVia.TRANSFER_ENGINE)
            await asyncio.sleep(1.0)  # the lease ends by time: its slots may be rewritten
            others = [bytes([0x80 + i]) * 16 for i in range(8)]
            await client.put(LAYOUT, others, [os.urandom(SIZE) for _ in others])  # evicts every leased block
            with pytest.raises(TornRead):
                await asyncio.to_thread(client.transfer_engine._copy, engine, stale, None)
        # the client, leasing afresh, still returns the right bytes (from disk, promoted into slots again)
        assert [bytes(b) for b in await client.get(LAYOUT, HASHES)] == PAYLOADS
    finally:
        await client.close()
        shard.stop()


async def test_a_peer_never_told_a_lease_gets_nothing(shard, engine):
    client = _client(shard, KvTransport.MOONCAKE)
    try:
        await client.put(LAYOUT, HASHES, PAYLOADS)
        # without the data-plane secret there is no lease: no session id, no address
        async with DataPlaneClient(shard.address, "x" * 32) as stranger:
            with pytest.raises(DataPlaneAuthError):
                await stranger.lease_blocks(LAYOUT, HASHES, "", via=LeaseVia.TRANSFER_ENGINE)
        async with DataPlaneClient(shard.address, shard.secret) as plane:
            lease = await plane.lease_blocks(LAYOUT, HASHES, "", via=LeaseVia.TRANSFER_ENGINE)
            await plane.release_lease(lease.lease_id)
        region = lease.remote_region
        assert region is not None and region.session_id == shard.session_id
        dst = np.zeros(SIZE, np.uint8)
        address = dst.ctypes.data
        # only the registered region is served: its neighbours are not
        end = region.slots_address + 16 * region.slot_bytes
        for outside in (region.headers_address - (1 << 20), end):
            with pytest.raises(TransferFailed):
                engine.read(region.session_id, [Transfer(address, outside, SIZE)])
        # once the shard closed its store, the region is unregistered: the old addresses give nothing
        shard.command("close-store")
        with pytest.raises(TransferFailed):
            engine.read(region.session_id, [Transfer(address, region.slots_address, SIZE)])
        assert not dst.any()
    finally:
        await client.close()


async def test_a_slot_overwritten_through_the_engine_is_served_by_no_path(shard, engine):
    """The TE has no authentication: a peer that reaches it can write registered memory. The readers' checksums
    (from the shard's index, not the region) stop such bytes on both paths."""
    te = _client(shard, KvTransport.MOONCAKE)
    try:
        await te.put(LAYOUT, HASHES[:1], PAYLOADS[:1])
        async with DataPlaneClient(shard.address, shard.secret) as plane:
            lease = await plane.lease_blocks(LAYOUT, HASHES[:1], "", via=LeaseVia.TRANSFER_ENGINE)
            await plane.release_lease(lease.lease_id)
        region, grant = lease.remote_region, lease.slots[0]
        assert region is not None
        garbage = np.frombuffer(os.urandom(SIZE), np.uint8).copy()
        engine.register_buffer(garbage)
        engine.write(region.session_id, [Transfer(garbage.ctypes.data,
                                                  region.slots_address + grant.slot * region.slot_bytes, SIZE)])
        engine.unregister(garbage.ctypes.data)
        with pytest.raises(ChecksumError):  # the TE read fails its checksum; the data-plane get is refused too
            await te.get(LAYOUT, HASHES[:1])
        assert te.transfer_engine.num_fallbacks == 1 and te.transfer_engine.num_blocks == 0
    finally:
        await te.close()


async def test_without_the_engine_on_the_shard_the_data_plane_serves(tmp_path, engine):
    from deepinfer.dataplane import DataPlaneServer
    from deepinfer.kvcache.store import KvStore, StoreSettings

    secret = generate_secret()
    store = KvStore(StoreSettings(ram_bytes=16 * SLOT, disk_dir=tmp_path / "kv", shm_dir=Path("/dev/shm"),
                                  shm_slot_bytes=SLOT))
    server = DataPlaneServer(store, secret=secret)
    await server.start()
    client = KvStoreClient(secret, timeout_s=30, shard_lease_s=3600, transport=KvTransport.MOONCAKE)
    client.shards.observe(KvStoreHeartbeat(shard="s0", data_plane_address=server.address, internal_address="-",
                                           ts=time.time(), host_id=store.host_id, shm=True, transfer_engine=True))
    try:
        await client.put(LAYOUT, HASHES, PAYLOADS)
        assert [bytes(b) for b in await client.get(LAYOUT, HASHES)] == PAYLOADS
        assert client.transfer_engine.num_fallbacks == 1 and client.transfer_engine.num_blocks == 0
        async with DataPlaneClient(server.address, secret) as plane:
            with pytest.raises(DataPlaneError, match="no transfer-engine reads"):
                await plane.lease_blocks(LAYOUT, HASHES, "", via=LeaseVia.TRANSFER_ENGINE)
    finally:
        await client.close()
        await server.close(drain_timeout_s=5)
        store.close()


async def test_a_shard_process_with_transfer_engine_on_serves_a_worker(nats_server, bus, tmp_path, monkeypatch,
                                                                      engine):
    from tests.integration.test_kvcache_service import next_heartbeat, start_shard

    data_dir, log = tmp_path / "data", tmp_path / "kvcache.log"
    monkeypatch.setenv("DEEPINFER_KVCACHE_SHM_RAM", "true")
    monkeypatch.setenv("DEEPINFER_KVCACHE_TRANSFER_ENGINE", "true")
    monkeypatch.setenv("DEEPINFER_KVCACHE_RAM_BYTES", str(4 << 20))
    monkeypatch.setenv("DEEPINFER_KVCACHE_SHM_SLOT_BYTES", str(SLOT))
    shard = start_shard(nats_server, data_dir, log)
    client = KvStoreClient("s" * 32, timeout_s=30, shard_lease_s=3600, transport=KvTransport.MOONCAKE)
    try:
        beat = await next_heartbeat(bus, log)
        assert beat.shm and beat.transfer_engine
        await client.start(bus)
        await asyncio.sleep(0.5)  # a heartbeat reaches the client
        await client.put(LAYOUT, HASHES, PAYLOADS)
        assert [bytes(b) for b in await client.get(LAYOUT, HASHES)] == PAYLOADS
        assert client.transfer_engine.num_blocks == len(HASHES), log.read_text()[-3000:]
    finally:
        await client.close()
        shard.send_signal(signal.SIGTERM)
        assert shard.wait(30) == 0, log.read_text()[-3000:]
