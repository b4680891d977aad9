"""Where a decode step's host time goes on a GPU: the engine alone (no service), async scheduling and CUDA graphs
as on one device, `B` requests decoding at `--context` tokens, with the torch profiler's per-op host cost.

    PYTHONPATH=shared:. python bench/gpu/decode_step_profile.py --random-model llama-1b --batches 64,256 --context 320 --out FILE

Per batch size: the step (wall / steps of `EngineCore.step`), the captured forward's GPU time alone (back-to-back
replays: the step's floor), the GPU-busy share of a profiled window, and the ops and CUDA runtime calls with the
most host time a step (self CPU µs a step, calls a step). A step whose wall is well above its replay and whose GPU
is idle much of the time is host-bound: its per-op host cost is what to cut.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from bench.gpu import gpu_decode
from bench.gpu.harness import make_engine
from bench.results_io import emit_json_line


def op_table(prof, steps: int, top: int) -> list[dict]:
    """The `top` host-side events by self CPU time: name, calls and self CPU µs a step."""
    rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    rows.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"name": e.key, "calls": round(e.count / steps, 2), "self_cpu_us": round(e.self_cpu_time_total / steps, 1)}
            for e in rows[:top]]


def launch_us(engine, batch: int, max_seq_len: int, launches: int = 20) -> float:
    """Host µs of one `CUDAGraph.replay()` (cudaGraphLaunch) of the decode graph, the device queue absorbing them."""
    graphs = engine.runner.graphs
    graph = graphs.graphs[batch, graphs.bucket(max_seq_len)]
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(launches):
        graph.replay()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return 1e6 * elapsed / launches


def replay_kernels(engine, batch: int, max_seq_len: int, top: int = 14, replays: int = 5) -> dict:
    """The decode graph's kernels (torch profiler, CUDA only): kernels and device µs a replay, the top ones."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.graphs
    graph = graphs.graphs[batch, graphs.bucket(max_seq_len)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    return {"kernels_per_replay": round(sum(e.count for e in kernels) / replays, 1),
            "kernel_us_per_replay": round(sum(e.device_time_total for e in kernels) / replays, 1),
            "top": [{"name": e.key[:70], "calls": round(e.count / replays, 1),
                     "us": round(e.device_time_total / replays, 1)} for e in kernels[:top]]}


def host_phases(engine, rng, batch: int, steps: int) -> dict:
    """Host ms a step in the parts of EngineCore.step (wrapped methods, no profiler)."""
    from bench.gpu.host_overhead import PhaseTimer

    runner, timer = engine.runner, PhaseTimer()
    for owner, method, phase in ((engine.scheduler, "schedule", "schedule"), (engine.scheduler, "update", "update"),
                                 (runner, "execute_async", "execute_async"), (runner, "prepare_batch", "prepare"),
                                 (runner.graphs, "run", "graph_run"), (runner.model, "compute_logits", "logits"),
                                 (runner.sampling_metadata, "build", "sampling_metadata"),
                                 (runner.sampler, "forward", "sampler"), (runner.sampled_tokens, "record", "record"),
                                 (engine, "finish_in_flight", "finish_in_flight")):
        timer.wrap(owner, method, phase)
    try:
        ids = gpu_decode.start_decodes(engine, rng, batch, steps + 16)
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        timer.reset()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        engine.abort_requests(ids)
    finally:
        timer.restore()
    return {"step_ms": round(1e3 * elapsed / steps, 3),
            **{name: round(1e3 * s / steps, 3) for name, s in timer.seconds.items()}}


def measure(engine, rng, batch: int, steps: int, top: int) -> dict:
    """Step time, replay floor, GPU-busy share and the op tables at `batch`."""
    from torch.profiler import ProfilerActivity

    timed = gpu_decode.decode_ours(engine, rng, batch, steps, eager=False)
    max_seq_len = gpu_decode.CONTEXT + steps
    floor = gpu_decode.replay_ms(engine, batch, max_seq_len)
    busy = gpu_decode.busy_fraction(engine, rng, batch, 24, eager=False)
    prof = gpu_decode.profiled_decode(engine, rng, batch, 24, False, [ProfilerActivity.CPU, ProfilerActivity.CUDA])
    cpu_only = gpu_decode.profiled_decode(engine, rng, batch, 24, False, [ProfilerActivity.CPU])
    return {"batch": batch, "step_ms": timed["step_ms"], "replay_ms": round(floor, 3),
            "launch_us": round(launch_us(engine, batch, max_seq_len), 1),
            "phases_ms": host_phases(engine, rng, batch, steps),
            "gpu_busy_fraction": busy.get("gpu_busy_fraction"), "ops": op_table(prof, 24, top),
            "ops_cpu_only": op_table(cpu_only, 24, top), "replay": replay_kernels(engine, batch, max_seq_len)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-model", default="llama-1b")
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench-models"))
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--no-graph-sampling", action="store_true",
                        help="the decode graphs end at the hidden states (graph_sampling off): the sampler every step")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from deepinfer.testing.random_model import write_random_model

    gpu_decode.CONTEXT = args.context
    model_dir = write_random_model(args.random_model, args.cache_dir)
    engine, build_s = make_engine(model_dir, async_scheduling=True, graph_sampling=not args.no_graph_sampling)
    rng = np.random.default_rng(0)
    result = {"bench": "decode_step_profile", "model": args.random_model, "context": args.context,
              "device": torch.cuda.get_device_name(),
              "graph_sampling": not args.no_graph_sampling, "build_s": round(build_s, 1), "points": []}
    for batch in (int(b) for b in args.batches.split(",")):
        started = time.perf_counter()
        point = measure(engine, rng, batch, args.steps, args.top)
        result["points"].append(point)
        replay = point["replay"]
        print(f"B={batch}: step {point['step_ms']} ms, replay {point['replay_ms']} ms (launch {point['launch_us']} "
              f"µs, {replay['kernels_per_replay']} kernels, {replay['kernel_us_per_replay']} µs of kernels), GPU busy "
              f"{point['gpu_busy_fraction']} ({time.perf_counter() - started:.0f} s)\n  host ms a step: {point['phases_ms']}")
        for title, ops in (("with CUDA activity", point["ops"]), ("CPU only", point["ops_cpu_only"])):
            print(f"  {'op (' + title + ')':58s} {'calls':>6s} {'self µs':>8s}")
            for op in ops:
                print(f"  {op['name'][:58]:58s} {op['calls']:6.2f} {op['self_cpu_us']:8.1f}")
        print(f"  {'kernel of one replay':70s} {'calls':>6s} {'µs':>8s}")
        for k in replay["top"]:
            print(f"  {k['name']:70s} {k['calls']:6.1f} {k['us']:8.1f}")
    emit_json_line(result, args.out)


if __name__ == "__main__":
    main()
