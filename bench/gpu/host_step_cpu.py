"""Thread CPU time of each engine step on the CPU, as percentiles: a steadier figure than a mean on a shared machine.

    PYTHONPATH=shared:. python bench/gpu/host_step_cpu.py [--batch 64] [--async]

The same engine as bench/gpu/host_overhead.py (deepinfer.testing.cpu_graph_engine: fake model, CUDA-graph host
path; `--async`: EngineCore.step with async scheduling; else the synchronous step as EngineCore runs it), no phase
wrappers; every step's CLOCK_THREAD_CPUTIME_ID time, 4 x 64 steps after 3 warm-up steps. Time other processes
take is not in a thread's CPU time, but they still slow it down (caches, shared cores), so the low percentiles
(p10, p25) of adjacent runs are what compare two commits best. Works with commits before `update_sampled`
(their synchronous step: `update`, then each output's token attached, as their EngineCore did). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from deepinfer.testing.cpu_graph_engine import build, build_async_engine


def main() -> None:
    """Print p10 / p25 / median ms of thread CPU time per step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--async", dest="async_mode", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as the worker does (bench/gpu/host_overhead.py)
    max_tokens = 4 * 64 + 32
    if args.async_mode:
        step = build_async_engine(args.batch, args.context, 16, max_tokens=max_tokens).step
    else:
        scheduler, runner = build(args.batch, args.context, 16, max_tokens=max_tokens)
        if hasattr(scheduler, "update_sampled"):
            def step() -> None:
                output = scheduler.schedule()
                scheduler.update_sampled(output, runner.execute(output, scheduler.requests))
        else:  # before update_sampled: EngineCore's update, then _engine_outputs
            from deepinfer.engine.core import _engine_outputs

            def step() -> None:
                output = scheduler.schedule()
                sampled = runner.execute(output, scheduler.requests)
                updates = scheduler.update(output, {rid: [t.token_id] for rid, t in sampled.items()})
                _engine_outputs(updates, sampled)
    for _ in range(3):
        step()
    clock, times = time.CLOCK_THREAD_CPUTIME_ID, []
    for _ in range(4 * 64):
        start = time.clock_gettime(clock)
        step()
        times.append(time.clock_gettime(clock) - start)
    times.sort()
    print(json.dumps({"mode": "async" if args.async_mode else "sync", "batch": args.batch, "context": args.context,
                      "p10_ms": round(1e3 * times[len(times) // 10], 4), "p25_ms": round(1e3 * times[len(times) // 4], 4),
                      "median_ms": round(1e3 * statistics.median(times), 4)}))


if __name__ == "__main__":
    main()
