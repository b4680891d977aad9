"""Store gets through Mooncake Transfer Engine over loopback TCP, beside a raw socket of the same bytes, the
data-plane get and the shared-memory path, in one run (CPU).

    PYTHONPATH=shared:. python -m bench.kv.transfer_engine [--block-mib 2] [--blocks 64] [--reps 10] [--out FILE]

A kvcache shard (KvStore with its RAM tier in a /dev/shm slot region, registered with the shard's transfer engine,
behind a DataPlaneServer) and a raw socket server (bench.kv.kvstore's) run in processes of their own; this
process reads the same --blocks blocks into the same preallocated rows (registered with its engine once) each
way, the paths taking turns request by request:

    transfer engine     KvStoreClient.get, kv_transport=mooncake: lease over the data plane, one engine batch of
                        the slots into the rows, one of their headers (seq check), xxh3-64 verified, release
    engine read only    TransferEngine.read of the same slots into the rows: the engine's own speed (no lease,
                        no checks)
    raw socket          a blocking socket sending the same number of bytes into one buffer (the floor for TCP)
    data plane          KvStoreClient.get, kv_transport=dataplane (today's socket path, checksums verified)
    shared memory       KvStoreClient.get, same host: copy out of the read-only mapping (the node-local path)

GB/s = bytes of one request / its wall time, median of --reps. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.kv.kv_shm import SECRET, _shard
from bench.kv.kvstore import RawPath, _raw_server, _start

LAYOUT = "bench-layout"
PATHS = ("transfer engine", "engine read only", "raw socket", "data plane", "shared memory")


async def _run(args, address: str, shard_host_id: str, raw_port: int) -> dict[str, list[float]]:
    from deepinfer.dataplane import DataPlaneClient
    from deepinfer.dataplane.frames import LeaseVia
    from deepinfer.dataplane.transfer_engine import Transfer
    from deepinfer.kvcache.client import KvStoreClient, KvTransport
    from deepinfer.protocol import KvStoreHeartbeat

    block_bytes = args.block_mib << 20
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, (args.blocks, block_bytes), dtype=np.uint8)
    rows = np.empty_like(source)
    rows.fill(1)  # fault the rows' pages in before anything is timed
    into = [memoryview(row) for row in rows]
    hashes = [i.to_bytes(16, "little") for i in range(args.blocks)]
    clients = {}
    for path, transport in (("transfer engine", KvTransport.MOONCAKE), ("data plane", KvTransport.DATAPLANE),
                            ("shared memory", KvTransport.AUTO)):
        client = KvStoreClient(SECRET, timeout_s=300, shard_lease_s=3600, host_id=shard_host_id,
                               transport=transport)
        client.shards.observe(KvStoreHeartbeat(shard="s0", data_plane_address=address, internal_address="-",
                                               ts=time.time(), host_id=shard_host_id, shm=True,
                                               transfer_engine=True))
        clients[path] = client
    await clients["data plane"].put(LAYOUT, hashes, list(source))
    reads = clients["transfer engine"].transfer_engine
    reads.register(rows)
    engine = reads.engine()
    async with DataPlaneClient(address, SECRET) as plane:  # the slots, for the engine-only reads
        lease = await plane.lease_blocks(LAYOUT, hashes, "", via=LeaseVia.TRANSFER_ENGINE)
    region = lease.remote_region
    assert region is not None
    raw_transfers = [Transfer(rows[i].ctypes.data, region.slots_address + g.slot * region.slot_bytes, g.size)
                     for i, g in enumerate(lease.slots)]
    raw = RawPath(raw_port, [bytes(args.blocks * block_bytes)])

    async def once(path: str) -> float:
        start = time.perf_counter()
        if path == "engine read only":
            await asyncio.to_thread(engine.read, region.session_id, raw_transfers)
        elif path == "raw socket":
            await raw.get(1)  # its one "block" is the whole request's bytes
        else:
            await clients[path].get(LAYOUT, hashes, into=into)
        return time.perf_counter() - start

    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    for path in PATHS:  # warm-up: connections, the engine's sessions, the mapping
        await once(path)
    for _ in range(args.reps):
        for path in PATHS:
            seconds[path].append(await once(path))
            if path != "raw socket":
                assert np.array_equal(rows, source), f"{path} returned other bytes"
                rows.fill(0)
    assert reads.num_blocks == (args.reps + 1) * args.blocks and reads.num_fallbacks == 0
    assert clients["shared memory"].shared_memory.num_blocks == (args.reps + 1) * args.blocks
    await raw.close()
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
    shard = ctx.Process(target=_shard, args=(child, (args.blocks + 4) * slot_bytes, slot_bytes, True))
    shard.start()
    raw_server, _, raw_port = _start(_raw_server)
    try:
        address, host_id = parent.recv()
        seconds = asyncio.run(_run(args, address, host_id, raw_port))
    finally:
        parent.send("stop")
        shard.join(30)
        raw_server.join(10)
    request_bytes = args.blocks * slot_bytes
    result = {
        "bench": "transfer_engine", "command": " ".join(sys.argv), "blocks": args.blocks,
        "block_mib": args.block_mib, "reps": args.reps, "host": platform.node(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "ts": time.time(),
        "gbps": {path: request_bytes / statistics.median(s) / 1e9 for path, s in seconds.items()},
        "median_ms": {path: statistics.median(s) * 1e3 for path, s in seconds.items()},
    }
    print(f"{args.blocks} blocks x {args.block_mib} MiB per request, median of {args.reps}, loopback, CPU only; "
          f"load average {result['load_average'][0]:.2f}")
    for path in PATHS:
        print(f"  {path:18s} {result['gbps'][path]:7.2f} GB/s  {result['median_ms'][path]:8.1f} ms")
    from bench.results_io import emit_json_line

    emit_json_line(result, args.out)


if __name__ == "__main__":
    main()
