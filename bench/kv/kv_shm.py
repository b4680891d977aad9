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

GB/s = bytes of one request / its wall time, median of --reps. CPU only: the GPU path (pinned registration of the
mapping, copies on the copy stream) is not built yet. Prints a table and one JSON line.
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


def _shard(conn, ram_bytes: int, slot_bytes: int) -> None:
    """Child process: a store shard with a shared-memory RAM tier on a free port; sends (address, host_id)."""
    from deepinfer.dataplane import DataPlaneServer
    from deepinfer.kvcache.store import KvStore, StoreSettings

    async def serve() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            store = KvStore(StoreSettings(ram_bytes=ram_bytes, disk_dir=Path(tmp) / "kv", shm_dir=Path("/dev/shm"),
                                          shm_slot_bytes=slot_bytes))
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


def main() -> None:
    """Run the comparison; print the table and one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-mib", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    slot_bytes = args.block_mib << 20
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    shard = ctx.Process(target=_shard, args=(child, (args.blocks + 4) * slot_bytes, slot_bytes))
    shard.start()
    try:
        address, host_id = parent.recv()
        seconds = asyncio.run(_run(args, address, host_id))
    finally:
        parent.send("stop")
        shard.join(30)
    request_bytes = args.blocks * slot_bytes
    result = {
        "bench": "kv_shm", "command": " ".join(sys.argv), "blocks": args.blocks, "block_mib": args.block_mib,
        "reps": args.reps, "host": platform.node(), "cpus": os.cpu_count(), "ts": time.time(),
        "gbps": {path: request_bytes / statistics.median(s) / 1e9 for path, s in seconds.items()},
        "median_ms": {path: statistics.median(s) * 1e3 for path, s in seconds.items()},
    }
    print(f"{args.blocks} blocks x {args.block_mib} MiB per request, median of {args.reps} (CPU only)")
    for path in PATHS:
        print(f"  {path:14s} {result['gbps'][path]:7.2f} GB/s  {result['median_ms'][path]:8.1f} ms")
    from bench.results_io import emit_json_line

    emit_json_line(result, args.out)


if __name__ == "__main__":
    main()
