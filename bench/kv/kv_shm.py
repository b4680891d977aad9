"""Store gets on one host: through the shard's shared memory vs through the data-plane socket vs a plain memcpy.

    PYTHONPATH=shared:. python bench/kv/kv_shm.py [--block-mib 2] [--blocks 64] [--reps 10] [--out FILE]

A kvcache shard (KvStore with its RAM tier in /dev/shm, behind a DataPlaneServer) runs in a process of its own;
the worker side, in this one, reads the same --blocks blocks into the same preallocated rows (a staging pool)
each way, the paths taking turns request by request:

    shared memory   KvStoreClient.get of a same-host shard: lease over the data plane, copy each slot out of the
                    read-only mapping (seqlock checked), xxh3-64 verified, release
    data plane      KvStoreClient.get as a worker on another host id: the bytes through the loopback socket,
                    received into the rows, xxh3-64 verified (today's path)
    memcpy          numpy.copyto of the same bytes from one in-process array into the rows (the floor on the CPU)
    xxh3            hashing the same bytes once (what both store paths pay to verify every block)

GB/s = bytes of one request / its wall time, median of --reps. Prints a table and one JSON line.

With --device cuda (a GPU; the same shard), the store's GPU paths beside a pinned copy_ of the same bytes, each
request read as a load reads it (store_tier.load_staged through the worker's staging pool: chunks of
--chunk-blocks, 16 blocks of 2 MiB, a lease per chunk; the engine thread's hop and the scatter left out):

    shm → device (DMA)   the worker's path on CUDA: per chunk lease, seq checked, the slots DMA'd from the
                         registered region into the chunk's device rows on a copy stream (ChunkSlotCopies,
                         slot_dma.copy_slots), the event waited for, seq checked again, release (no xxh3:
                         kv_store_shm_verify_checksums off), then the import's read of the device rows; the
                         chunks' gets overlap (4 chunks in the pool)
    shm → pinned → device  the CPU path on a GPU: the shared-memory get into pinned rows (copy + xxh3), then one
                         non_blocking copy_ of the chunk to the device
    registered copy_     the registered region's slots → device rows, no lease or check: the DMA alone
    pinned copy_         one pinned host tensor of the request's bytes → the device (the issue's yardstick)

and the one-off cudaHostRegister of the shard's region (seconds). Goal (issue 31): shm → device ≥ 80% of the
pinned copy_.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from deepinfer.dataplane.frames import checksum

SECRET = "kv-shm-bench-secret-0123456789abcdef"
LAYOUT = "bench-layout"
PATHS = ("shared memory", "data plane", "memcpy", "xxh3")


def _shard(conn, ram_bytes: int, slot_bytes: int, transfer_engine: bool = False) -> None:
    """Child process: a store shard with a shared-memory RAM tier on a free port (its slots also served through
    Mooncake Transfer Engine when `transfer_engine`); sends (address, host_id)."""
    from deepinfer.dataplane import DataPlaneServer
    from deepinfer.kvcache.store import KvStore, StoreSettings

    async def serve() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            store = KvStore(StoreSettings(ram_bytes=ram_bytes, disk_dir=Path(tmp) / "kv", shm_dir=Path("/dev/shm"),
                                          shm_slot_bytes=slot_bytes))
            if transfer_engine:
                from deepinfer.dataplane.transfer_engine import TransferEngine

                store.serve_transfer_engine(TransferEngine.start("127.0.0.1"))
            server = DataPlaneServer(store, secret=SECRET)
            await server.start()
            conn.send((server.address, store.host_id))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
            await server.close()
            store.close()

    asyncio.run(serve())


async def _run(args, address: str, shard_host_id: str) -> dict[str, list[float]]:
    from deepinfer.kvcache.client import KvStoreClient
    from deepinfer.protocol import KvStoreHeartbeat

    block_bytes = args.block_mib << 20
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, (args.blocks, block_bytes), dtype=np.uint8)
    rows = np.empty_like(source)
    rows.fill(1)  # fault the rows' pages in before anything is timed
    into = [memoryview(row) for row in rows]
    hashes = [i.to_bytes(16, "little") for i in range(args.blocks)]
    clients = {}
    for path, host_id in (("shared memory", shard_host_id), ("data plane", "another-host/bench")):
        client = KvStoreClient(SECRET, timeout_s=300, shard_lease_s=3600, host_id=host_id)
        client.shards.observe(KvStoreHeartbeat(shard="s0", data_plane_address=address, internal_address="-",
                                               ts=time.time(), host_id=shard_host_id, shm=True))
        clients[path] = client
    await clients["data plane"].put(LAYOUT, hashes, list(source))

    async def once(path: str) -> float:
        start = time.perf_counter()
        if path == "memcpy":
            np.copyto(rows, source)
        elif path == "xxh3":
            for row in source:
                checksum(row)
        else:
            await clients[path].get(LAYOUT, hashes, into=into)
        return time.perf_counter() - start

    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    for path in PATHS:  # warm-up: connections, the mapping, the allocator
        await once(path)
    for _ in range(args.reps):
        for path in PATHS:
            seconds[path].append(await once(path))
            if path in clients:
                assert np.array_equal(rows, source), f"{path} returned other bytes"
                rows.fill(0)
    assert clients["shared memory"].shared_memory.num_blocks == (args.reps + 1) * args.blocks
    assert clients["data plane"].shared_memory.num_blocks == 0
    for client in clients.values():
        await client.close()
    return seconds


GPU_PATHS = ("shm -> device (DMA)", "shm -> pinned -> device", "registered copy_", "pinned copy_")


class _EngineThread:
    """The engine thread as a load uses it, applying commands at once on this thread (CopySlots → copy_slots on
    the pool's copy stream): the worker's path without the hop to its engine thread."""

    def __init__(self, device) -> None:
        self.device = device

    async def call(self, command):
        return command.apply(self)

    def copy_slots(self, pool, chunk, src, slots, nbytes, positions):
        from deepinfer.engine.slot_dma import copy_slots

        return copy_slots(pool, chunk, src, slots, nbytes, positions, self.device)


async def _run_gpu(args, address: str, shard_host_id: str) -> tuple[dict[str, list[float]], float]:
    import torch

    from deepinfer.dataplane import DataPlaneClient
    from deepinfer.engine.kv_load import LOAD_CHUNKS
    from deepinfer.engine.kv_transfer import StagingPool
    from deepinfer.engine.slot_dma import CudaRegistrar
    from deepinfer.kvcache.client import KvStoreClient
    from deepinfer.protocol import KvStoreHeartbeat
    from deepinfer.worker.slot_copies import ChunkSlotCopies
    from deepinfer.worker.store_tier import load_staged

    device = torch.device("cuda")
    block_bytes, chunk = args.block_mib << 20, args.chunk_blocks
    source = torch.randint(0, 256, (args.blocks, block_bytes), dtype=torch.uint8)
    on_device = source.to(device)
    pinned = source.pin_memory()
    hashes = [i.to_bytes(16, "little") for i in range(args.blocks)]
    client = KvStoreClient(SECRET, timeout_s=300, shard_lease_s=3600, host_id=shard_host_id)
    client.shards.observe(KvStoreHeartbeat(shard="s0", data_plane_address=address, internal_address="-",
                                           ts=time.time(), host_id=shard_host_id, shm=True))
    await client.put(LAYOUT, hashes, list(source.numpy()))
    client.shared_memory.use_device(CudaRegistrar(device))
    started = time.perf_counter()
    registered = await client.prepare_shared_memory(LAYOUT)
    register_s = time.perf_counter() - started
    if not registered:
        raise SystemExit("cudaHostRegister of the region failed (see the log): no DMA path on this machine")
    pool = StagingPool(block_bytes, chunk, LOAD_CHUNKS, pin=True)  # the worker's pool: 4 chunks
    engine = _EngineThread(device)
    rows = torch.empty((args.blocks, block_bytes), dtype=torch.uint8, device=device)
    region = client.shared_memory.registered_regions()[0]  # the bench's one region

    def to_device(staging, positions):
        return ChunkSlotCopies(engine, pool, staging, positions)

    def done() -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()
        return event

    async def read_device_rows(first: int, host_rows, device_rows=None):
        """The import's read of a chunk's device rows (d2d; no scatter): every block must have come by DMA."""
        n = host_rows.shape[0]
        assert device_rows is not None and len(device_rows.positions) == n, "fell back to the data plane"
        rows[first : first + n].copy_(device_rows.rows)
        return True, done()

    async def upload_host_rows(first: int, host_rows):
        """The import's h2d of a chunk's pinned host rows (no scatter)."""
        rows[first : first + host_rows.shape[0]].copy_(host_rows, non_blocking=True)
        return True, done()

    async def dma() -> None:  # load_staged as a CUDA worker runs it: chunks' gets overlapping, slots DMA'd
        assert await load_staged(client, LAYOUT, hashes, [None] * args.blocks, pool, read_device_rows, to_device)

    async def cpu_then_h2d() -> None:  # the same without a destination: the CPU copies, then one h2d a chunk
        assert await load_staged(client, LAYOUT, hashes, [None] * args.blocks, pool, upload_host_rows)

    async with DataPlaneClient(address, SECRET) as plane:  # where each block's slot is, for the raw copy
        lease = await plane.lease_blocks(LAYOUT, hashes, shard_host_id)
        await plane.release_lease(lease.lease_id)
    slots = lease.slots

    async def registered_copy() -> None:
        for i, ref in enumerate(slots):
            rows[i].copy_(region.tensor[ref.slot, : ref.size], non_blocking=True)
        torch.cuda.synchronize()

    async def pinned_copy() -> None:
        rows.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    runs = dict(zip(GPU_PATHS, (dma, cpu_then_h2d, registered_copy, pinned_copy), strict=True))
    seconds: dict[str, list[float]] = {path: [] for path in GPU_PATHS}
    for path, fn in runs.items():  # warm-up, and every path moves exactly the source's bytes
        rows.zero_()
        await fn()
        torch.cuda.synchronize()
        assert torch.equal(rows, on_device), f"{path} moved other bytes"
    for _ in range(args.reps):
        for path, fn in runs.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            await fn()
            torch.cuda.synchronize()
            seconds[path].append(time.perf_counter() - start)
    await client.close()
    return seconds, register_s


def main() -> None:
    """Run the comparison; print the table and one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-mib", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU paths (DMA from the registered region vs a pinned copy_)")
    parser.add_argument("--chunk-blocks", type=int, default=16, help="blocks per lease and copy (--device cuda)")
    args = parser.parse_args()
    slot_bytes = args.block_mib << 20
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA")
            return
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    shard = ctx.Process(target=_shard, args=(child, (args.blocks + 4) * slot_bytes, slot_bytes))
    shard.start()
    try:
        address, host_id = parent.recv()
        register_s = None
        if args.device == "cuda":
            seconds, register_s = asyncio.run(_run_gpu(args, address, host_id))
        else:
            seconds = asyncio.run(_run(args, address, host_id))
    finally:
        parent.send("stop")
        shard.join(30)
    request_bytes = args.blocks * slot_bytes
    result = {
        "bench": "kv_shm", "command": " ".join(sys.argv), "blocks": args.blocks, "block_mib": args.block_mib,
        "reps": args.reps, "device": args.device, "host": platform.node(), "cpus": os.cpu_count(), "ts": time.time(),
        "gbps": {path: request_bytes / statistics.median(s) / 1e9 for path, s in seconds.items()},
        "median_ms": {path: statistics.median(s) * 1e3 for path, s in seconds.items()},
    }
    print(f"{args.blocks} blocks x {args.block_mib} MiB per request, median of {args.reps} ({args.device})")
    for path in seconds:
        print(f"  {path:24s} {result['gbps'][path]:7.2f} GB/s  {result['median_ms'][path]:8.1f} ms")
    if register_s is not None:
        pinned = result["gbps"]["pinned copy_"]
        result["register_s"] = register_s
        result["dma_vs_pinned"] = result["gbps"][GPU_PATHS[0]] / pinned
        result["chunk_blocks"] = args.chunk_blocks
        print(f"  shm -> device / pinned copy_: {result['dma_vs_pinned']:.2f} (goal 0.80); cudaHostRegister of the "
              f"{(args.blocks + 4) * slot_bytes / (1 << 30):.2f} GiB region: {register_s:.3f} s")
    from bench.results_io import emit_json_line

    emit_json_line(result, args.out)


if __name__ == "__main__":
    main()
