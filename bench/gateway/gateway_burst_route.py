"""The route round trip of a burst against the real scheduler: is its reply slow, or the gateway's loop busy?

    PYTHONPATH=shared:. python bench/gateway/gateway_burst_route.py [--bursts 1 16 64] [--rounds 20] [--out FILE]

A real nats-server and the real scheduler (`python -m services.scheduler`, its own process, the code of this
checkout); one decode worker's heartbeats (room for every request) from this process, which then sends bursts
of N RouteRequests at once (as N requests reaching the gateways at once would: bench/gateway/gateway_burst.py's prompts
are ~30 tokens, 2 block hashes) and times each round trip. Reports per N the round trip p50/p99 and the
scheduler process's CPU per route (user + system from /proc). With the scheduler's CPU per route c, the last of
a burst of N waits ~N x c in its queue; what the gateway sees beyond that is its own loop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.results_io import emit_json_line
from bench.serve.serve_hops import cpu_seconds
from deepinfer import subjects
from deepinfer.bus import Bus
from deepinfer.nats_server import NatsServer
from deepinfer.protocol import RouteDecision, RouteRequest, RouteStatus, WorkerLoad, WorkerRole

ROOT = Path(__file__).resolve().parents[2]

MODEL = "bench"
FINGERPRINT = b"\x01" * 32


def heartbeat() -> WorkerLoad:
    """One decode worker with room for every request of the bench."""
    return WorkerLoad(worker_id="decode-0", role=WorkerRole.DECODE, model=MODEL, model_fingerprint=FINGERPRINT,
                      layout_id="L", block_size=16, max_num_seqs=1_000_000, max_model_len=4096,
                      data_plane_address="127.0.0.1:9", internal_address="127.0.0.1:10", ts=time.time())


def route_request() -> RouteRequest:
    """A ~30-token prompt's route request (2 block hashes)."""
    return RouteRequest(request_id=uuid.uuid4().hex, gateway_id="g", block_hashes=[os.urandom(16) for _ in range(2)],
                        num_prompt_tokens=30, model_fingerprint=FINGERPRINT)


async def heartbeats(bus: Bus) -> None:
    """The decode worker's heartbeat every 0.5 s."""
    while True:
        await bus.publish(subjects.heartbeat(MODEL, "decode-0"), heartbeat())
        await asyncio.sleep(0.5)


async def timed_route(bus: Bus) -> float:
    """One route round trip (s); fails unless accepted."""
    started_s = time.perf_counter()
    decision = await bus.request(subjects.route(MODEL), route_request(), RouteDecision, 5.0)
    if decision.status is not RouteStatus.ACCEPTED:
        raise RuntimeError(f"route not accepted: {decision}")
    return time.perf_counter() - started_s


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start nats-server and the scheduler, then time bursts of every size."""
    nats = NatsServer()
    nats.start()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'shared'}:{ROOT}", "DEEPINFER_NATS_URL": nats.url,
           "DEEPINFER_NATS_TOKEN": nats.token, "DEEPINFER_SERVED_MODEL_NAME": MODEL,
           "DEEPINFER_SCHEDULER_INTERNAL_PORT": "0", "DEEPINFER_LOG_LEVEL": "warning"}
    scheduler = subprocess.Popen([sys.executable, "-m", "services.scheduler"], env=env, cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bus = await Bus.connect(nats.url, name="bench", token=nats.token)
    beats = asyncio.create_task(heartbeats(bus))
    try:
        deadline = time.monotonic() + 60
        while True:  # the scheduler warms up (waits for heartbeats) before it takes routes
            try:
                await timed_route(bus)
                break
            except Exception:
                if time.monotonic() > deadline or scheduler.poll() is not None:
                    raise
                await asyncio.sleep(0.2)
        results = []
        for n in args.bursts:
            await asyncio.gather(*(timed_route(bus) for _ in range(n)))  # warm-up
            cpu = cpu_seconds({"s": scheduler.pid})["s"]
            times: list[float] = []
            for _ in range(args.rounds):
                times += await asyncio.gather(*(timed_route(bus) for _ in range(n)))
                await asyncio.sleep(0.05)
            cpu = cpu_seconds({"s": scheduler.pid})["s"] - cpu
            times.sort()
            results.append({"n": n, "rounds": args.rounds,
                            "scheduler_cpu_us_per_route": round(cpu / len(times) * 1e6, 1),
                            "rtt_p50_ms": round(statistics.median(times) * 1000, 3),
                            "rtt_p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))] * 1000, 3)})
    finally:
        beats.cancel()
        await bus.close()
        scheduler.terminate()
        scheduler.wait(timeout=10)
        nats.stop()
    return {"bench": "gateway_burst_route", "label": args.label, "bursts": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(f"{'N':>4}{'sched CPU us/route':>20}{'RTT p50 ms':>12}{'p99 ms':>9}")
    for b in result["bursts"]:
        print(f"{b['n']:>4}{b['scheduler_cpu_us_per_route']:>20.0f}{b['rtt_p50_ms']:>12.2f}{b['rtt_p99_ms']:>9.2f}")
    emit_json_line(result, args.out, append=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
