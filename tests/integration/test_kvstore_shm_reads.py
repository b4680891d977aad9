"""A worker's store gets through a same-host shard's shared memory (deepinfer.kvcache.client.local): byte-identical
to the data-plane get, with and without receive buffers; never taken for another host id or a shard without the
region; and a real shard process on nats-server (DEEPINFER_KVCACHE_SHM_RAM) serving through it across kill -9.
The device path's protocol (a region registered once, slots copied to a destination's rows, the seq checked after
the copy: a rewritten slot is never used; a refused registration reads on the CPU) with numpy stand-ins for CUDA;
tests/gpu/test_store_shm_dma_gpu.py runs it on a GPU."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from deepinfer.dataplane import DataPlaneClient, DataPlaneError, DataPlaneServer, generate_secret
from deepinfer.kvcache.client import KvStoreClient
from deepinfer.kvcache.store import KvStore, StoreSettings
from deepinfer.protocol import KvStoreHeartbeat
from tests.integration.test_kvcache_service import next_heartbeat, start_shard

pytestmark = pytest.mark.integration

LAYOUT = "layout-shm"
SIZE = 48 * 1024
HASHES = [bytes([i]) * 16 for i in range(1, 9)]
PAYLOADS = [os.urandom(SIZE) for _ in HASHES]


@pytest.fixture
async def shard(tmp_path):
    secret = generate_secret()
    store = KvStore(StoreSettings(ram_bytes=16 * 64 * 1024, disk_dir=tmp_path / "kv", shm_dir=Path("/dev/shm"),
                                  shm_slot_bytes=64 * 1024))
    server = DataPlaneServer(store, secret=secret)
    await server.start()
    try:
        yield store, server, secret
    finally:
        await server.close(drain_timeout_s=5)
        store.close()


def _client(server: DataPlaneServer, secret: str, store: KvStore, *, host_id: str, shm: bool = True) -> KvStoreClient:
    client = KvStoreClient(secret, timeout_s=30, shard_lease_s=3600, host_id=host_id)
    client.shards.observe(KvStoreHeartbeat(shard="s0", data_plane_address=server.address, internal_address="-",
                                           ts=time.time(), host_id=store.host_id, shm=shm))
    return client


async def test_a_same_host_get_reads_shared_memory_and_matches_the_data_plane(shard):
    store, server, secret = shard
    client = _client(server, secret, store, host_id=store.host_id)
    try:
        await client.put(LAYOUT, HASHES, PAYLOADS)
        async with DataPlaneClient(server.address, secret) as plane:
            over_socket = await plane.get_blocks("", block_hashes=HASHES, layout_id=LAYOUT)
        assert over_socket == PAYLOADS
        got = await client.get(LAYOUT, HASHES)
        assert [bytes(b) for b in got] == over_socket
        rows = np.zeros((len(HASHES), SIZE), np.uint8)  # a staging pool's rows
        into = [memoryview(row) for row in rows]
        got = await client.get(LAYOUT, HASHES, into=into)
        assert all(g is buf for g, buf in zip(got, into, strict=True))
        assert [row.tobytes() for row in rows] == over_socket
        assert client.shared_memory.num_blocks == 2 * len(HASHES) and client.shared_memory.num_fallbacks == 0
        assert server.metrics.snapshot()["blocks_sent"] == len(HASHES)  # only the plain get's bytes crossed
    finally:
        await client.close()


async def test_another_host_or_a_shard_without_the_region_gets_over_the_data_plane(shard):
    store, server, secret = shard
    elsewhere = _client(server, secret, store, host_id="another-host/boot")
    plain = _client(server, secret, store, host_id=store.host_id, shm=False)
    try:
        await elsewhere.put(LAYOUT, HASHES, PAYLOADS)
        assert [bytes(b) for b in await elsewhere.get(LAYOUT, HASHES)] == PAYLOADS
        assert [bytes(b) for b in await plain.get(LAYOUT, HASHES)] == PAYLOADS
        assert elsewhere.shared_memory.num_blocks == plain.shared_memory.num_blocks == 0
        async with DataPlaneClient(server.address, secret) as plane:  # the shard refuses a lease to another host
            with pytest.raises(DataPlaneError, match="readers on host"):
                await plane.lease_blocks(LAYOUT, HASHES, "another-host/boot")
            lease = await plane.lease_blocks(LAYOUT, HASHES[:1], store.host_id)
            assert Path(lease.region_path).stat().st_mode & 0o777 == 0o600
            await plane.release_lease(lease.lease_id)
    finally:
        await elsewhere.close()
        await plain.close()


async def test_a_lease_the_shard_cannot_grant_falls_back_to_the_data_plane(shard):
    store, server, secret = shard
    client = _client(server, secret, store, host_id=store.host_id)
    big = [os.urandom(96 * 1024)]  # larger than a slot: on disk only, served over the socket
    try:
        await client.put(LAYOUT, [b"\x42" * 16], big)
        assert [bytes(b) for b in await client.get(LAYOUT, [b"\x42" * 16])] == big
        assert client.shared_memory.num_fallbacks == 1 and client.shared_memory.num_blocks == 0
    finally:
        await client.close()


async def test_a_shard_process_serves_shared_memory_across_kill_9(nats_server, bus, tmp_path, monkeypatch):
    data_dir, log = tmp_path / "data", tmp_path / "kvcache.log"
    monkeypatch.setenv("DEEPINFER_KVCACHE_SHM_RAM", "true")
    monkeypatch.setenv("DEEPINFER_KVCACHE_RAM_BYTES", str(4 << 20))
    monkeypatch.setenv("DEEPINFER_KVCACHE_SHM_SLOT_BYTES", str(64 * 1024))
    shard = start_shard(nats_server, data_dir, log)
    client = KvStoreClient("s" * 32, timeout_s=30, shard_lease_s=3600)
    try:
        beat = await next_heartbeat(bus, log)
        assert beat.shm and beat.host_id == client.shared_memory.host_id
        await client.start(bus)
        await asyncio.sleep(0.5)  # a heartbeat reaches the client
        await client.put(LAYOUT, HASHES, PAYLOADS)
        assert [bytes(b) for b in await client.get(LAYOUT, HASHES)] == PAYLOADS
        assert client.shared_memory.num_blocks == len(HASHES)
        region = Path((data_dir / "kvcache" / "t1" / "SHM_REGION").read_text())

        shard.send_signal(signal.SIGKILL)
        shard.wait(10)
        shard = start_shard(nats_server, data_dir, log)
        await next_heartbeat(bus, log)
        await asyncio.sleep(0.5)
        assert not region.exists()  # the restarted shard unlinked its predecessor's region
        assert [bytes(b) for b in await client.get(LAYOUT, HASHES)] == PAYLOADS  # from disk, into the new region
        assert client.shared_memory.num_blocks == 2 * len(HASHES)
    finally:
        await client.close()
        shard.send_signal(signal.SIGTERM)
        assert shard.wait(30) == 0, log.read_text()[-3000:]


def test_the_bench_compares_the_three_paths_in_one_run(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "kv-shm.json"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root / 'shared'}:{root}"}
    subprocess.run([sys.executable, "bench/kv/kv_shm.py", "--blocks", "4", "--block-mib", "1", "--reps", "2",
                    "--out", str(out)], cwd=root, env=env, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert set(result["gbps"]) == {"shared memory", "data plane", "memcpy", "xxh3"}
    assert all(v > 0 for v in result["gbps"].values())


async def test_a_cancelled_get_returns_only_once_its_copy_stopped_writing_the_buffers(shard):
    import threading

    store, server, secret = shard
    client = _client(server, secret, store, host_id=store.host_id)
    started, proceed = threading.Event(), threading.Event()
    copy = client.shared_memory._copy

    def held_copy(*args):
        started.set()
        proceed.wait(30)
        return copy(*args)

    client.shared_memory._copy = held_copy
    try:
        await client.put(LAYOUT, HASHES[:1], PAYLOADS[:1])
        row = np.zeros(SIZE, np.uint8)
        task = asyncio.create_task(client.get(LAYOUT, HASHES[:1], into=[memoryview(row)]))
        assert await asyncio.to_thread(started.wait, 30)
        task.cancel()
        await asyncio.sleep(0.2)
        assert not task.done()  # the copy thread may still write `row`: the get has not returned
        proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert row.tobytes() == PAYLOADS[0]  # written before the cancelled get returned, never after
    finally:
        proceed.set()
        await client.close()


# -- the device path (a GPU's: deepinfer.engine.slot_dma), here with a registrar and a destination in numpy -------
class _Registered:
    """A region 'registered': the slots array the destination copies from."""

    def __init__(self, slots: np.ndarray) -> None:
        self.slots, self.unregistered = slots, False

    def unregister(self) -> None:
        self.unregistered = True


class _Registrar:
    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.regions = refuse, []

    def register(self, slots: np.ndarray) -> _Registered | None:
        if self.refuse:
            return None
        self.regions.append(_Registered(slots))
        return self.regions[-1]


class _DeviceRows:
    """A SlotDestination whose 'device rows' are a numpy array; `after_copy` runs once the copy is done (before
    the reader's second seq check)."""

    def __init__(self, num_rows: int, after_copy=None) -> None:
        self.rows = np.zeros((num_rows, SIZE), np.uint8)
        self.on_device: list[int] = []
        self.after_copy = after_copy

    async def copy(self, region: _Registered, refs, indexes) -> None:
        for ref, i in zip(refs, indexes, strict=True):
            self.rows[i, : ref.size] = region.slots[ref.slot, : ref.size]
        if self.after_copy is not None:
            self.after_copy(refs)


async def test_a_device_get_copies_slots_to_the_device_rows_and_not_the_host_rows(shard):
    store, server, secret = shard
    client = _client(server, secret, store, host_id=store.host_id)
    registrar = _Registrar()
    client.shared_memory.use_device(registrar)
    try:
        await client.put(LAYOUT, HASHES, PAYLOADS)
        assert await client.prepare_shared_memory(LAYOUT) == 1  # mapped and registered before any load
        assert len(client.shared_memory.registered_regions()) == 1
        rows = np.zeros((len(HASHES), SIZE), np.uint8)
        device = _DeviceRows(len(HASHES))
        await client.get(LAYOUT, HASHES, into=[memoryview(row) for row in rows], device=device)
        assert sorted(device.on_device) == list(range(len(HASHES)))
        assert [row.tobytes() for row in device.rows] == PAYLOADS
        assert not rows.any()  # the CPU never copied them
        assert client.shared_memory.num_device_blocks == len(HASHES) and client.shared_memory.num_fallbacks == 0
        assert len(registrar.regions) == 1  # registered once, for every get
        await client.get(LAYOUT, HASHES, into=[memoryview(row) for row in rows], device=_DeviceRows(len(HASHES)))
        assert len(registrar.regions) == 1
    finally:
        await client.close()
    assert registrar.regions[0].unregistered  # before the unmap


async def test_a_slot_rewritten_before_the_device_copy_is_checked_is_not_used(shard):
    store, server, secret = shard
    client = _client(server, secret, store, host_id=store.host_id)
    client.shared_memory.use_device(_Registrar())
    region = store._ram.region  # the shard's side: rewrite the slot (same bytes, a new seq) under the reader

    def rewrite(refs) -> None:
        ref = refs[3]
        region.write(ref.slot, region.view(ref.slot, ref.size).tobytes(), ref.key_digest)

    try:
        await client.put(LAYOUT, HASHES, PAYLOADS)
        rows = np.zeros((len(HASHES), SIZE), np.uint8)
        device = _DeviceRows(len(HASHES), after_copy=rewrite)
        await client.get(LAYOUT, HASHES, into=[memoryview(row) for row in rows], device=device)
        assert device.on_device == []  # nothing of the torn lease is used from the device
        assert [row.tobytes() for row in rows] == PAYLOADS  # the data plane served them into the host rows
        assert client.shared_memory.num_fallbacks == 1 and client.shared_memory.num_device_blocks == 0
    finally:
        await client.close()


async def test_a_region_the_device_refuses_is_read_on_the_cpu(shard):
    store, server, secret = shard
    client = _client(server, secret, store, host_id=store.host_id)
    client.shared_memory.use_device(_Registrar(refuse=True))
    try:
        await client.put(LAYOUT, HASHES, PAYLOADS)
        rows = np.zeros((len(HASHES), SIZE), np.uint8)
        device = _DeviceRows(len(HASHES))
        await client.get(LAYOUT, HASHES, into=[memoryview(row) for row in rows], device=device)
        assert device.on_device == [] and [row.tobytes() for row in rows] == PAYLOADS
        assert client.shared_memory.num_blocks == len(HASHES) and client.shared_memory.num_fallbacks == 0
    finally:
        await client.close()


@pytest.mark.parametrize("verify", [False, True])
async def test_the_device_paths_checksum_pass_catches_a_slot_corrupted_in_place(shard, verify: bool):
    store, server, secret = shard
    client = _client(server, secret, store, host_id=store.host_id)
    client.shared_memory.use_device(_Registrar(), verify_checksums=verify)
    try:
        await client.put(LAYOUT, HASHES, PAYLOADS)
        region = store._ram.region
        async with DataPlaneClient(server.address, secret) as plane:
            lease = await plane.lease_blocks(LAYOUT, HASHES[:1], store.host_id)
            await plane.release_lease(lease.lease_id)
        region._mapped.slots[lease.slots[0].slot, 7] ^= 0xFF  # a bit flip in the RAM tier, no seq change
        rows = np.zeros((len(HASHES), SIZE), np.uint8)
        device = _DeviceRows(len(HASHES))
        with contextlib.suppress(DataPlaneError):  # the data plane then refuses the corrupt block, or serves it
            await client.get(LAYOUT, HASHES, into=[memoryview(row) for row in rows], device=device)
        if verify:  # caught before anything was marked as on the device: the get fell back
            assert device.on_device == [] and client.shared_memory.num_fallbacks == 1
        else:  # off (the default): the lease and the seqlock do not see a corruption in place
            assert sorted(device.on_device) == list(range(len(HASHES)))
            assert device.rows[0].tobytes() != PAYLOADS[0]
    finally:
        await client.close()
