"""The router's speed on the CPU: KV event ingest into the index, and route decisions over a large index.

    PYTHONPATH=shared:. python bench/serve/router.py [--blocks 1000000] [--workers 32] [--decisions 20000] [--out bench/results/X.json]

Simulated, through the real code: 32 workers (half prefill, half decode) join a SchedulerHandler (its KvIndex
and PrefixPolicy, built from SchedulerSettings) with an empty snapshot each; then each worker's KvEventBatch
stream (64 stored hashes per batch, prefix chains of 64 blocks, every chain on 2 workers) is applied until the
index holds --blocks (worker, block) entries. Ingest is timed twice: msgpack bytes → KvEventBatch → index (what
the scheduler's subscription does), and the index alone. Decisions: RouteRequests of 16-64 blocks whose first
part matches an indexed chain (on 2 workers) and whose tail is new, each `handler.route` timed (the policy over
the index and the members, plus the in-flight bookkeeping; the bus round trip is not included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

from deepinfer.config import CommonSettings, SchedulerSettings
from deepinfer.protocol import (
    KvEvent,
    KvEventBatch,
    KvEventKind,
    RouteRequest,
    SnapshotPage,
    WorkerLoad,
    WorkerRole,
)
from deepinfer.telemetry import new_registry
from deepinfer.testing import FakeBroker, FakeBus
from services.scheduler.handler import SchedulerHandler, build_handler

CHAIN_BLOCKS = 64
BATCH_HASHES = 64
FP = b"f" * 32


def block_hash(chain: int, i: int) -> bytes:
    return chain.to_bytes(8, "big") + i.to_bytes(8, "big")


def heartbeat(worker_id: str, role: WorkerRole, rng: random.Random) -> WorkerLoad:
    return WorkerLoad(
        worker_id=worker_id, role=role, model="m", model_fingerprint=FP, layout_id="L", block_size=16,
        max_num_seqs=256, max_model_len=32768, num_running=rng.randrange(0, 32), num_waiting=rng.randrange(0, 4),
        num_free_blocks=rng.randrange(1000, 40000), num_total_blocks=40000, data_plane_address="127.0.0.1:1",
        internal_address="127.0.0.1:2", epoch="e", num_received=0, ts=0.0,
    )


async def join(handler: SchedulerHandler, num_workers: int, rng: random.Random) -> list[str]:
    """Heartbeats of every worker, then (no worker answers snapshots here) an empty snapshot applied for each."""
    workers = []
    for w in range(num_workers):
        role = WorkerRole.PREFILL if w % 2 == 0 else WorkerRole.DECODE
        await handler.on_heartbeat(heartbeat(f"w{w:02d}", role, rng), None)
    await handler.kv_feed.close()  # cancels the snapshot requests before they start
    index = handler.kv_feed.index
    for w in range(num_workers):
        worker_id = f"w{w:02d}"
        index.begin_snapshot(worker_id)
        index.apply_page(SnapshotPage(worker_id=worker_id, seq=0, epoch="e"))
        index.end_snapshot(worker_id)
        workers.append(worker_id)
    return workers


def event_batches(workers: list[str], num_entries: int) -> list[bytes]:
    """Encoded batches: chain c's blocks on workers c % n and (c + 1) % n, seq +1 per worker."""
    seqs = dict.fromkeys(workers, 0)
    batches = []
    num_chains = num_entries // (2 * CHAIN_BLOCKS)
    for chain in range(num_chains):
        for worker_id in (workers[chain % len(workers)], workers[(chain + 1) % len(workers)]):
            for start in range(0, CHAIN_BLOCKS, BATCH_HASHES):
                seqs[worker_id] += 1
                hashes = [block_hash(chain, i) for i in range(start, start + BATCH_HASHES)]
                event = KvEvent(event_kind=KvEventKind.STORED, block_hashes=hashes)
                batches.append(KvEventBatch(worker_id=worker_id, seq=seqs[worker_id], events=[event], ts=0.0,
                                            epoch="e").to_bytes())
    return batches


def ingest(handler: SchedulerHandler, batches: list[bytes], decode: bool) -> float:
    index = handler.kv_feed.index
    started = time.perf_counter()
    if decode:
        for data in batches:
            index.apply_batch(KvEventBatch.from_bytes(data))
    else:
        decoded = [KvEventBatch.from_bytes(data) for data in batches]
        started = time.perf_counter()
        for batch in decoded:
            index.apply_batch(batch)
    return time.perf_counter() - started


def decide(handler: SchedulerHandler, num_chains: int, num_decisions: int, rng: random.Random) -> list[float]:
    """Timed `handler.route` calls; every 64, each worker's heartbeat shows the requests routed to it arrived."""
    loads = {m.worker_id: heartbeat(m.worker_id, m.role, rng) for m in handler.membership.members()}
    latencies = []
    for r in range(num_decisions):
        chain, num_blocks = rng.randrange(num_chains), rng.randrange(16, 65)
        hit = rng.randrange(0, min(num_blocks, CHAIN_BLOCKS) + 1)
        hashes = [block_hash(chain, i) for i in range(hit)] + [block_hash(10**9 + r, i) for i in range(num_blocks - hit)]
        request = RouteRequest(request_id=f"r{r}", gateway_id="g", block_hashes=hashes,
                               num_prompt_tokens=16 * num_blocks, model_fingerprint=FP)
        started = time.perf_counter()
        handler.route(request)
        latencies.append(time.perf_counter() - started)
        if r % 64 == 63:
            for worker_id, num in handler.in_flight.counts().items():
                loads[worker_id].num_received = (loads[worker_id].num_received or 0) + num
                asyncio.run(handler.on_heartbeat(loads[worker_id], None))
    return latencies


def run(num_entries: int, num_workers: int, num_decisions: int) -> dict:
    rng = random.Random(0)
    settings = SchedulerSettings(common=CommonSettings(served_model_name="m"), scheduler_id="bench",
                                 kv_index_max_entries=max(num_entries, 1))
    batches_a = event_batches([f"w{w:02d}" for w in range(num_workers)], num_entries)

    async def setup() -> SchedulerHandler:
        handler = build_handler(settings, FakeBus(FakeBroker(), "bench"), new_registry(False), rng=rng,
                                clock=lambda: 0.0)  # leases never run out: no heartbeats to keep them
        await join(handler, num_workers, rng)
        return handler

    with_decode = asyncio.run(setup())
    decode_s = ingest(with_decode, batches_a, decode=True)
    handler = asyncio.run(setup())
    index_s = ingest(handler, batches_a, decode=False)
    del with_decode
    index = handler.kv_feed.index
    latencies = sorted(decide(handler, num_entries // (2 * CHAIN_BLOCKS), num_decisions, rng))
    num_hashes = len(batches_a) * BATCH_HASHES
    return {
        "workers": num_workers,
        "index_entries": index.num_entries,
        "index_blocks": index.num_blocks(),
        "ingest_batches": len(batches_a),
        "ingest_blocks_per_s_with_decode": num_hashes / decode_s,
        "ingest_batches_per_s_with_decode": len(batches_a) / decode_s,
        "ingest_blocks_per_s_index_only": num_hashes / index_s,
        "decisions": num_decisions,
        "decisions_per_s": num_decisions / sum(latencies),
        "decision_p50_ms": 1000 * statistics.median(latencies),
        "decision_p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="(worker, block) entries to index")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = run(args.blocks, args.workers, args.decisions)
    for key, value in result.items():
        print(f"{key:>36}: {value:,.1f}" if isinstance(value, float) else f"{key:>36}: {value:,}")
    line = json.dumps(result, sort_keys=True)
    print(line)
    if args.out is not None:
        args.out.write_text(line + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
