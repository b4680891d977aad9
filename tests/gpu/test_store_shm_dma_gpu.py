"""Store loads from a same-host shard's shared memory straight to the device (written without a GPU at hand; run it
on one): the region registered with cudaHostRegister (read-only), each chunk's leased slots DMA'd into its device
rows by the engine's CopySlots, then imported with DeviceRows. A load that way writes exactly the blocks of the
data-plane get; a slot rewritten (its seq changed) between the copy and the check is not used: the data plane
serves that chunk, and the torn device rows never reach the cache."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from deepinfer.dataplane import DataPlaneClient, DataPlaneServer, generate_secret  # noqa: E402
from deepinfer.engine.commands import EngineCommand  # noqa: E402
from deepinfer.engine.kv_transfer import (  # noqa: E402
    StagingPool,
    block_nbytes,
    export_blocks,
    import_blocks,
    import_device_rows,
    import_rows,
)
from deepinfer.engine.slot_dma import CudaRegistrar, RegisteredSlots, copy_slots  # noqa: E402
from deepinfer.kernels import get_ops  # noqa: E402
from deepinfer.kernels.torch_block_copy import layer_table  # noqa: E402
from deepinfer.kvcache.client import KvStoreClient  # noqa: E402
from deepinfer.kvcache.store import KvStore, StoreSettings  # noqa: E402
from deepinfer.protocol import KvStoreHeartbeat  # noqa: E402
from deepinfer.worker.slot_copies import ChunkSlotCopies  # noqa: E402
from deepinfer.worker.store_tier import load_staged  # noqa: E402

LAYOUT = "layout-dma"
NUM_BLOCKS = 24  # three chunks of 8
DEVICE = torch.device("cuda")


def _caches(seed: int | None) -> list[torch.Tensor]:
    # 64 KiB a block in bf16 over 4 layers: a page multiple, one slot each
    shape = (2, NUM_BLOCKS + 1, 16, 4, 64)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]


class _EngineThread:
    """The engine thread as the load uses it: commands applied in order (CopySlots → copy_slots on the pool's
    copy stream; the imports on the current stream)."""

    def __init__(self) -> None:
        self.num_copies = 0

    async def call(self, command: EngineCommand):
        return command.apply(self)

    def copy_slots(self, pool, chunk, src, slots, nbytes, positions) -> torch.cuda.Event:
        self.num_copies += 1
        return copy_slots(pool, chunk, src, slots, nbytes, positions, DEVICE)


@contextlib.asynccontextmanager
async def _shard(tmp_path):
    """A KvStore with its RAM tier in /dev/shm behind a data-plane server, and a client that knows it (the GPU tier
    runs without pytest-asyncio: each test drives its own loop)."""
    nbytes = block_nbytes(_caches(None))
    secret = generate_secret()
    store = KvStore(
        StoreSettings(
            ram_bytes=64 * nbytes, disk_dir=tmp_path / "kv", shm_dir=Path("/dev/shm"), shm_slot_bytes=nbytes
        )
    )
    server = DataPlaneServer(store, secret=secret)
    await server.start()
    client = KvStoreClient(secret, timeout_s=30, shard_lease_s=3600, host_id=store.host_id)
    client.shards.observe(
        KvStoreHeartbeat(
            shard="s0",
            data_plane_address=server.address,
            internal_address="-",
            ts=time.time(),
            host_id=store.host_id,
            shm=True,
        )
    )
    try:
        yield store, server, secret, client
    finally:
        await client.close()
        await server.close(drain_timeout_s=5)
        store.close()


async def _load(client: KvStoreClient, hashes, target, engine: _EngineThread, copies=ChunkSlotCopies) -> bool:
    pool = StagingPool(block_nbytes(target), chunk_blocks=8, num_chunks=2, pin=True)
    table, ops = layer_table(target), get_ops("cuda")

    async def import_chunk(first: int, rows, device=None):
        ids = list(range(1 + first, 1 + first + rows.shape[0]))
        if device is None:
            return True, import_rows(target, ids, rows, ops, table)
        return True, import_device_rows(target, ids, rows, device, ops, table)

    def to_device(chunk, positions):
        return copies(engine, pool, chunk, positions)

    loaded = await load_staged(client, LAYOUT, hashes, [None] * len(hashes), pool, import_chunk, to_device)
    torch.cuda.synchronize()
    return loaded


def test_a_dma_load_writes_exactly_the_data_plane_blocks(tmp_path):
    asyncio.run(_dma_load_writes_exactly_the_data_plane_blocks(tmp_path))


async def _dma_load_writes_exactly_the_data_plane_blocks(tmp_path):
    async with _shard(tmp_path) as (store, server, secret, client):
        source = _caches(seed=1)
        ids = list(range(1, NUM_BLOCKS + 1))
        payloads, hashes = export_blocks(source, ids), [i.to_bytes(16, "little") for i in ids]
        await client.put(LAYOUT, hashes, payloads)
        client.shared_memory.use_device(CudaRegistrar(DEVICE))
        assert await client.prepare_shared_memory(LAYOUT) == 1, "cudaHostRegister (read-only | portable) refused"
        engine, target = _EngineThread(), _caches(None)
        assert await _load(client, hashes, target, engine)
        assert client.shared_memory.num_device_blocks == NUM_BLOCKS and client.shared_memory.num_fallbacks == 0
        assert engine.num_copies == 3  # one CopySlots per chunk
        async with DataPlaneClient(server.address, secret) as plane:  # the data-plane get of the same blocks
            over_socket = await plane.get_blocks("", block_hashes=hashes, layout_id=LAYOUT)
        expected = _caches(None)
        import_blocks(expected, ids, over_socket)
        torch.cuda.synchronize()
        for a, b in zip(target, expected, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        region = next(iter(client.shared_memory._regions.values())).registered.result()
        assert isinstance(region, RegisteredSlots) and region.registered
        await client.close()
        assert not region.registered  # unregistered (then unmapped) when the client closed


def test_a_slot_rewritten_before_the_check_is_not_used(tmp_path):
    asyncio.run(_slot_rewritten_before_the_check_is_not_used(tmp_path))


async def _slot_rewritten_before_the_check_is_not_used(tmp_path):
    async with _shard(tmp_path) as (store, server, secret, client):
        source = _caches(seed=2)
        ids = list(range(1, NUM_BLOCKS + 1))
        payloads, hashes = export_blocks(source, ids), [i.to_bytes(16, "little") for i in ids]
        await client.put(LAYOUT, hashes, payloads)
        client.shared_memory.use_device(CudaRegistrar(DEVICE))
        region = store._ram.region  # the shard's side of the region

        class TornOnce(ChunkSlotCopies):
            """The second chunk's slot 0 is rewritten (same bytes, a new seq) after its copy completed, and the device
            rows are scribbled as a torn DMA would leave them: neither may reach the cache."""

            calls = 0
            torn = False

            async def copy(self, registered, refs, indexes) -> None:
                await super().copy(registered, refs, indexes)
                TornOnce.calls += 1
                if TornOnce.calls == 2:
                    TornOnce.torn = True
                    ref = refs[0]
                    region.write(ref.slot, region.view(ref.slot, ref.size).tobytes(), ref.key_digest)
                    self.chunk.device_rows.fill_(0x7F)
                    torch.cuda.synchronize()

        engine, target = _EngineThread(), _caches(None)
        assert await _load(client, hashes, target, engine, copies=TornOnce)
        assert TornOnce.torn
        assert client.shared_memory.num_fallbacks == 1  # that chunk came over the data plane
        assert client.shared_memory.num_device_blocks == NUM_BLOCKS - 8
        for a, b in zip(target, source, strict=True):
            assert torch.equal(a[:, 1:].view(torch.int16), b[:, 1:].view(torch.int16))


def test_a_region_registers_read_only_and_copies_slots_bitwise():
    from deepinfer.kvcache.shm.region import SlotReader, SlotRegion

    region = SlotRegion(Path("/dev/shm"), num_slots=8, slot_bytes=1 << 16)
    try:
        blocks = [torch.randint(0, 256, (1 << 16,), dtype=torch.uint8) for _ in range(8)]
        for slot, block in enumerate(blocks):
            region.write(slot, block.numpy(), digest=slot)
        reader = SlotReader(region.path)
        registered = CudaRegistrar(DEVICE).register(reader.slots)
        assert registered is not None, "cudaHostRegister (read-only | portable) refused"
        pool = StagingPool(1 << 16, chunk_blocks=8, num_chunks=1, pin=True)
        chunk = asyncio.run(pool.acquire())
        slots, positions = [5, 6, 7, 0, 2], [0, 1, 2, 3, 7]  # a merged run (5, 6, 7) and single slots
        copy_slots(pool, chunk, registered.tensor, slots, 1 << 16, positions, DEVICE).synchronize()
        for slot, position in zip(slots, positions, strict=True):
            assert torch.equal(chunk.device_rows[position].cpu(), blocks[slot])
        registered.unregister()
        reader.close()
    finally:
        region.close()
