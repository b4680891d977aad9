"""Where a worker's load from the kvcache store spends its time on this machine: lookup, get, import.

    PYTHONPATH=shared:. python bench/kv/store_load.py [--blocks 256] [--reps 3] [--chunk-blocks 16]

A kvcache shard (DataPlaneServer over a RAM-only KvStore) runs in a process of its own, holding --blocks blocks of
the 8B shape (32 layers x K/V x 16 tokens x 8 heads x 128 dims, bf16: 2 MiB a block). This process is the worker:
its event loop runs the service's KvStoreClient, and one thread stands in for the engine thread (EngineLoop.call
runs there, FIFO) with CPU caches of that shape. Each rep loads every block once, through each path in turn:

    legacy   client.get (every payload a bytes) ─► engine thread: import_blocks (a fresh staging buffer of the
             whole load, a memcpy of each payload into it, one scatter per layer)
    staged   the worker's load pipeline (deepinfer.worker.store_tier.load_staged): per chunk, get into rows of a
             reusable staging pool ─► engine thread: import_rows (one scatter_blocks of every layer) while the
             loop receives the next chunk; the engine thread's work is O(chunks)

Columns: lookup (has), get (wall of the receives; staged: of the whole pipeline, the imports overlapped with it; loop CPU: the event-loop thread's CPU time over the load,
checksums included; checksum: xxh3-64 of the same bytes timed alone), engine (the engine thread's busy time:
staging allocation, memcpy, scatter), total (lookup → imported). Medians of --reps. What only a GPU measures (the
pinned allocation's cost, the H2D copy and its overlap with the receive) is not here: on the CPU the "device"
is the caches' memory and pinning is off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
SECRET = "store-load-bench-secret-0123456789"
LAYOUT = "bench-8b"
#: The 8B shape: layers, K/V, block_size, kv heads, head dim (bf16): 2 MiB a block.
SHAPE = (32, 2, 16, 8, 128)


def _server(conn, ram_bytes: int) -> None:
    from deepinfer.dataplane import DataPlaneServer
    from deepinfer.kvcache.store import KvStore, StoreSettings

    store = KvStore(StoreSettings(ram_bytes=ram_bytes))

    async def serve() -> None:
        server = DataPlaneServer(store, secret=SECRET)
        conn.send(await server.start())
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.close()

    asyncio.run(serve())
    store.close()


class EngineThread:
    """One thread, FIFO, like EngineLoop.call; counts its busy seconds."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.busy_s = 0.0

    async def call(self, fn):
        def timed():
            started = time.perf_counter()
            try:
                return fn(None)
            finally:
                self.busy_s += time.perf_counter() - started

        return await asyncio.get_running_loop().run_in_executor(self._pool, timed)


def _caches(num_blocks: int) -> list[torch.Tensor]:
    layers, planes, block_size, heads, dim = SHAPE
    return [torch.zeros((planes, num_blocks + 1, block_size, heads, dim), dtype=torch.bfloat16)
            for _ in range(layers)]


async def _legacy(client, engine: EngineThread, caches, hashes: list[bytes]) -> dict:
    from deepinfer.engine.kv_transfer import import_blocks

    payloads = await client.get(LAYOUT, hashes)
    get_done = time.perf_counter()
    await engine.call(lambda _: import_blocks(caches, list(range(1, len(hashes) + 1)), payloads))
    return {"get_done": get_done, "payloads": payloads}


def _legacy_parts(caches, payloads: list[bytes]) -> dict:
    """import_blocks' steps timed one by one (a replica, outside the timed load): a fresh staging buffer of the
    whole load (its pages faulted in by the first write), the memcpy of every payload, the scatter per layer."""
    import numpy as np

    from deepinfer.kernels import get_ops

    n, nbytes = len(payloads), len(payloads[0])
    t0 = time.perf_counter()
    staging = torch.empty((n, nbytes), dtype=torch.uint8)
    staging.numpy()[:, :: 4096] = 0  # what the first memcpy pays: one fault per page
    t1 = time.perf_counter()
    staging_np = staging.numpy()
    for i, payload in enumerate(payloads):
        staging_np[i] = np.frombuffer(payload, dtype=np.uint8)
    t2 = time.perf_counter()
    get_ops("cpu").scatter_blocks(staging, caches, torch.arange(1, n + 1), None)
    t3 = time.perf_counter()
    return {"alloc_fault_s": t1 - t0, "memcpy_s": t2 - t1, "scatter_s": t3 - t2}


async def _staged(client, engine: EngineThread, caches, hashes: list[bytes], pool) -> dict:
    from deepinfer.engine.kv_transfer import import_rows
    from deepinfer.kernels import get_ops
    from deepinfer.worker.store_tier import load_staged

    ops = get_ops("cpu")
    block_ids = list(range(1, len(hashes) + 1))

    def import_chunk(first: int, rows):
        ids = block_ids[first : first + rows.shape[0]]
        return engine.call(lambda _: (True, import_rows(caches, ids, rows, ops)))

    loaded = await load_staged(client, LAYOUT, hashes, [None] * len(hashes), pool, import_chunk)
    assert loaded
    return {"get_done": time.perf_counter(), "payloads": None}


async def _one(path: str, args, client, engine, caches, hashes, pool) -> dict:
    engine.busy_s = 0.0
    started, cpu0 = time.perf_counter(), time.thread_time()
    present = await client.has(LAYOUT, hashes)
    assert all(present)
    looked_up = time.perf_counter()
    if path == "legacy":
        out = await _legacy(client, engine, caches, hashes)
    else:
        out = await _staged(client, engine, caches, hashes, pool)
    done = time.perf_counter()
    loop_cpu = time.thread_time() - cpu0
    row = {"lookup_s": looked_up - started, "get_s": out["get_done"] - looked_up, "loop_cpu_s": loop_cpu,
           "engine_s": engine.busy_s, "total_s": done - started}
    if out["payloads"] is not None:
        from deepinfer.dataplane.frames import checksum

        t0 = time.perf_counter()
        for payload in out["payloads"]:
            checksum(payload)
        row["checksum_s"] = time.perf_counter() - t0
        row.update(_legacy_parts(caches, out["payloads"]))
    return row


async def _run(args, address: str, paths: list[str]) -> dict:
    from deepinfer.kvcache.client import KvStoreClient
    from deepinfer.protocol import KvStoreHeartbeat

    block_nbytes = 2 * SHAPE[0] * SHAPE[2] * SHAPE[3] * SHAPE[4] * 2
    blocks = [os.urandom(block_nbytes) for _ in range(min(args.blocks, 8))]
    hashes = [i.to_bytes(16, "little") for i in range(args.blocks)]
    client = KvStoreClient(SECRET, timeout_s=300, shard_lease_s=3600)
    client.shards.observe(KvStoreHeartbeat(shard="s0", data_plane_address=address, internal_address="-", ts=time.time()))
    for start in range(0, args.blocks, 32):
        part = hashes[start : start + 32]
        await client.put(LAYOUT, part, [blocks[(start + i) % len(blocks)] for i in range(len(part))])
    caches, engine = _caches(args.blocks), EngineThread()
    pool = None
    if "staged" in paths:
        from deepinfer.engine.kv_load import LOAD_CHUNKS
        from deepinfer.engine.kv_transfer import StagingPool

        pool = StagingPool(block_nbytes, args.chunk_blocks, num_chunks=LOAD_CHUNKS, pin=False)
    rows: dict[str, list[dict]] = {p: [] for p in paths}
    try:
        for path in paths:  # warm-up
            await _one(path, args, client, engine, caches, hashes, pool)
        for _ in range(args.reps):
            for path in paths:
                rows[path].append(await _one(path, args, client, engine, caches, hashes, pool))
        probe = next(iter(caches))[:, 1 : args.blocks + 1]
        assert probe.view(torch.int16).abs().sum() > 0, "nothing was imported"
    finally:
        await client.close()
    return {p: {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]} for p, rs in rows.items()}


def main() -> None:
    """Measure, print the table and the JSON line, save the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-blocks", type=int, default=16)
    parser.add_argument("--paths", default="legacy,staged")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    paths = args.paths.split(",")
    torch.set_num_threads(1)
    block_nbytes = 2 * SHAPE[0] * SHAPE[2] * SHAPE[3] * SHAPE[4] * 2
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    server = context.Process(target=_server, args=(child, block_nbytes * (args.blocks + 8)), daemon=True)
    server.start()
    try:
        results = asyncio.run(_run(args, parent.recv(), paths))
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        server.join(timeout=60)
    gib = args.blocks * block_nbytes / (1 << 30)
    print(f"{args.blocks} blocks x {block_nbytes >> 20} MiB = {gib:.2f} GiB, medians of {args.reps}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'path':<8}{'lookup':>8}{'get':>8}{'loop CPU':>9}{'checksum':>9}{'engine':>8}{'total':>8}{'GB/s':>7}")
    for path, r in results.items():
        print(f"{path:<8}{r['lookup_s']:>8.3f}{r['get_s']:>8.3f}{r['loop_cpu_s']:>9.3f}"
              f"{r.get('checksum_s', float('nan')):>9.3f}{r['engine_s']:>8.3f}{r['total_s']:>8.3f}"
              f"{args.blocks * block_nbytes / r['total_s'] / 1e9:>7.2f}")
    if "legacy" in results:
        r = results["legacy"]
        print(f"legacy engine part (replica): staging alloc + page faults {r['alloc_fault_s']:.3f} s, memcpy "
              f"{r['memcpy_s']:.3f} s, scatter (torch twin, per layer) {r['scatter_s']:.3f} s")
    result = {"bench": "store_load", "command": "python bench/kv/store_load.py " + " ".join(sys.argv[1:]),
              "host": platform.node(), "cpus": os.cpu_count(), "block_bytes": block_nbytes, "blocks": args.blocks,
              "reps": args.reps, "chunk_blocks": args.chunk_blocks, "results": results}
    print(json.dumps(result))
    out = args.out or RESULTS_DIR / f"store-load-cpu-{time.strftime('%Y-%m-%d-%H%M')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
