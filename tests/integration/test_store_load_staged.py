"""A worker's staged store load (store_tier.load_staged) against a real store shard on 127.0.0.1: chunks received
(over the socket, or through the shard's shared memory) into a StagingPool's rows and imported into CPU caches
while the next arrives; a miss mid-load and a request that stops loading leave nothing in flight."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from deepinfer.dataplane import BlockNotFound, DataPlaneServer, generate_secret
from deepinfer.engine.kv_transfer import StagingPool, block_nbytes, export_blocks, import_blocks, import_rows
from deepinfer.kernels import get_ops
from deepinfer.kvcache.client import KvStoreClient
from deepinfer.kvcache.store import KvStore, StoreSettings
from deepinfer.protocol import KvStoreHeartbeat
from deepinfer.worker.store_tier import load_staged

pytestmark = pytest.mark.integration

LAYOUT = "layout-staged"
NUM_BLOCKS = 10


def _caches(seed: int | None) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS + 1, 4, 2, 16)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(3)]


class Worker:
    """A store client and a one-thread 'engine' importing staged rows into CPU caches, counting calls."""

    def __init__(self, client: KvStoreClient, caches: list[torch.Tensor], pool: StagingPool) -> None:
        self.client, self.caches, self.pool = client, caches, pool
        self.engine = ThreadPoolExecutor(1)
        self.imported: list[int] = []
        self.calls: list[int] = []
        self.refuse_from: int | None = None

    def import_chunk(self, first: int, rows, device=None):
        def run() -> tuple[bool, None]:
            self.calls.append(first)
            time.sleep(0.01)  # a slow engine thread: the next chunk is received meanwhile
            if self.refuse_from is not None and first >= self.refuse_from:
                return False, None
            if device is not None:  # the rows the 'DMA' brought, over the host rows (import_device_rows' twin)
                positions = list(device.positions)
                rows[positions] = device.rows[positions]
            import_rows(self.caches, list(range(1 + first, 1 + first + rows.shape[0])), rows, get_ops("cpu"))
            self.imported.append(first)
            return True, None

        return asyncio.get_running_loop().run_in_executor(self.engine, run)


@pytest.fixture(params=["socket", "shared memory"])
async def shard(request, tmp_path):
    """A store shard and a worker's client of it: over the data-plane socket, or (same host id) through the
    shard's shared-memory RAM tier, its slots copied straight into the staging rows."""
    secret = generate_secret()
    shm = request.param == "shared memory"
    store = KvStore(StoreSettings(ram_bytes=4 << 20, disk_dir=tmp_path / "kv", shm_dir=Path("/dev/shm"),
                                  shm_slot_bytes=4096) if shm else StoreSettings(ram_bytes=64 << 20))
    server = DataPlaneServer(store, secret=secret)
    await server.start()
    client = KvStoreClient(secret, timeout_s=30, shard_lease_s=3600)
    client.shards.observe(KvStoreHeartbeat(shard="s0", data_plane_address=server.address, internal_address="-",
                                           ts=time.time(), host_id=store.host_id, shm=shm))
    try:
        yield client
    finally:
        await client.close()
        await server.close(drain_timeout_s=5)
        store.close()


async def test_a_staged_load_imports_the_stored_and_host_blocks_bitwise(shard):
    source = _caches(seed=3)
    payloads = export_blocks(source, list(range(1, NUM_BLOCKS + 1)))
    hashes = [bytes([i + 1]) * 16 for i in range(NUM_BLOCKS)]
    local = [payloads[i] if i in (0, 4) else None for i in range(NUM_BLOCKS)]  # two held by the host tier
    await shard.put(LAYOUT, [h for h, p in zip(hashes, local, strict=True) if p is None],
                    [p for p, held in zip(payloads, local, strict=True) if held is None])
    pool = StagingPool(block_nbytes(source), chunk_blocks=3, num_chunks=2, pin=False)
    worker = Worker(shard, _caches(None), pool)
    assert await load_staged(shard, LAYOUT, hashes, local, pool, worker.import_chunk)
    assert worker.imported == [0, 3, 6, 9]
    expected = _caches(None)
    import_blocks(expected, list(range(1, NUM_BLOCKS + 1)), payloads)
    for got, want in zip(worker.caches, expected, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert pool._free.qsize() == 2  # every chunk back
    assert shard.shared_memory.num_fallbacks == 0
    assert shard.shared_memory.num_blocks == (NUM_BLOCKS - 2 if shard.shards.live()["s0"].shm else 0)


async def test_a_miss_mid_load_raises_after_the_imports_in_flight(shard):
    source = _caches(seed=4)
    payloads = export_blocks(source, list(range(1, NUM_BLOCKS + 1)))
    hashes = [bytes([i + 40]) * 16 for i in range(NUM_BLOCKS)]
    await shard.put(LAYOUT, hashes[:5], payloads[:5])  # blocks 5.. are not stored: the second chunk misses
    pool = StagingPool(block_nbytes(source), chunk_blocks=4, num_chunks=2, pin=False)
    worker = Worker(shard, _caches(None), pool)
    with pytest.raises(BlockNotFound):
        await load_staged(shard, LAYOUT, hashes, [None] * NUM_BLOCKS, pool, worker.import_chunk)
    assert worker.imported == [0]  # the first chunk's import finished before the error came back
    assert pool._free.qsize() == 2


async def test_a_request_that_stops_loading_stops_the_load(shard):
    source = _caches(seed=5)
    payloads = export_blocks(source, list(range(1, NUM_BLOCKS + 1)))
    hashes = [bytes([i + 80]) * 16 for i in range(NUM_BLOCKS)]
    await shard.put(LAYOUT, hashes, payloads)
    pool = StagingPool(block_nbytes(source), chunk_blocks=2, num_chunks=1, pin=False)
    worker = Worker(shard, _caches(None), pool)
    worker.refuse_from = 2  # aborted after its first chunk: import_chunk answers False
    assert not await load_staged(shard, LAYOUT, hashes, [None] * NUM_BLOCKS, pool, worker.import_chunk)
    assert worker.imported == [0]
    assert worker.calls == [0, 2]  # no chunk received after the refusal was seen
    assert pool._free.qsize() == 1


class _Registered:
    def __init__(self, slots) -> None:
        self.slots = slots

    def unregister(self) -> None:
        pass


class _Registrar:
    def register(self, slots):
        return _Registered(slots)


class CpuSlotCopies:
    """ChunkSlotCopies' stand-in: the chunk's 'device rows' a CPU tensor, each copy a short wait (a DMA in flight)
    then a numpy copy out of the mapping; counts the copies in flight at once."""

    in_flight = max_in_flight = 0

    def __init__(self, chunk, positions) -> None:
        self.chunk, self.positions, self.on_device = chunk, list(positions), []
        if chunk.device_rows is None:
            chunk.device_rows = torch.zeros_like(chunk.rows)

    async def copy(self, region, refs, indexes) -> None:
        CpuSlotCopies.in_flight += 1
        CpuSlotCopies.max_in_flight = max(CpuSlotCopies.max_in_flight, CpuSlotCopies.in_flight)
        await asyncio.sleep(0.02)
        for ref, i in zip(refs, indexes, strict=True):
            self.chunk.device_rows[self.positions[i], : ref.size] = torch.from_numpy(
                region.slots[ref.slot, : ref.size].copy())
        CpuSlotCopies.in_flight -= 1

    def device_rows(self, num_rows: int):
        from deepinfer.engine import DeviceRows

        if not self.on_device:
            return None
        return DeviceRows(self.chunk.device_rows[:num_rows], tuple(self.positions[i] for i in self.on_device))


async def test_a_load_to_the_device_overlaps_its_chunks_and_imports_bitwise(shard):
    source = _caches(seed=6)
    payloads = export_blocks(source, list(range(1, NUM_BLOCKS + 1)))
    hashes = [bytes([i + 120]) * 16 for i in range(NUM_BLOCKS)]
    local = [payloads[i] if i == 4 else None for i in range(NUM_BLOCKS)]  # one held by the host tier
    await shard.put(LAYOUT, hashes, payloads)
    shard.shared_memory.use_device(_Registrar())
    pool = StagingPool(block_nbytes(source), chunk_blocks=3, num_chunks=2, pin=False)
    worker = Worker(shard, _caches(None), pool)
    CpuSlotCopies.max_in_flight = 0
    assert await load_staged(shard, LAYOUT, hashes, local, pool, worker.import_chunk, CpuSlotCopies)
    assert sorted(worker.imported) == [0, 3, 6, 9]
    expected = _caches(None)
    import_blocks(expected, list(range(1, NUM_BLOCKS + 1)), payloads)
    for got, want in zip(worker.caches, expected, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert pool._free.qsize() == 2
    shm = shard.shards.live()["s0"].shm
    assert shard.shared_memory.num_device_blocks == (NUM_BLOCKS - 1 if shm else 0)
    assert CpuSlotCopies.max_in_flight == (2 if shm else 0)  # a chunk's get while the other's copy ran


async def test_a_miss_mid_load_to_the_device_raises_after_every_chunk_in_flight(shard):
    source = _caches(seed=7)
    payloads = export_blocks(source, list(range(1, NUM_BLOCKS + 1)))
    hashes = [bytes([i + 160]) * 16 for i in range(NUM_BLOCKS)]
    await shard.put(LAYOUT, hashes[:5], payloads[:5])  # the second chunk misses
    shard.shared_memory.use_device(_Registrar())
    pool = StagingPool(block_nbytes(source), chunk_blocks=4, num_chunks=2, pin=False)
    worker = Worker(shard, _caches(None), pool)
    with pytest.raises(BlockNotFound):
        await load_staged(shard, LAYOUT, hashes, [None] * NUM_BLOCKS, pool, worker.import_chunk, CpuSlotCopies)
    assert worker.imported == [0]
    assert pool._free.qsize() == 2
