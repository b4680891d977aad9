"""Per-step times of decode steps at B=64 and B=256 (8B shape, random weights, bench/gpu/gpu.py's engine): step and
execute() ms (median, mean, max) and the gen-2 collections inside the window. A mean far above the median is a
pause, not a slower step (the front door's before/after, 2026-12-04: one 171 ms gen-2 collection among 32 steps).

    PYTHONPATH=shared:. python bench/gpu/decode_step_times.py TAG [--no-graph-sampling]     # on the GPU machine, from a tree's root
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.gpu import gpu_decode, harness


def step_times(engine, rng, batch: int, steps: int) -> dict:
    """`steps` timed decode steps of `batch` rows: per-step ms and the time inside runner.execute."""
    runner, inside = engine.runner, {"execute": 0.0}
    execute = runner.execute

    def timed_execute(*args, **kwargs):
        start = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            inside["execute"] += time.perf_counter() - start

    collections = [0]

    def count(phase: str, info: dict) -> None:
        collections[0] += phase == "start" and info["generation"] == 2

    runner.execute = timed_execute
    gc.callbacks.append(count)
    try:
        ids = gpu_decode.start_decodes(engine, rng, batch, steps + 16)
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        step_ms, execute_ms = [], []
        for _ in range(steps):
            inside["execute"], start = 0.0, time.perf_counter()
            engine.step()
            step_ms.append(1e3 * (time.perf_counter() - start))
            execute_ms.append(1e3 * inside["execute"])
        torch.cuda.synchronize()
        engine.abort_requests(ids)
    finally:
        del runner.execute  # the instance attribute shadowed the method
        gc.callbacks.remove(count)
    return {"step_median_ms": round(statistics.median(step_ms), 3), "step_mean_ms": round(statistics.mean(step_ms), 3),
            "step_max_ms": round(max(step_ms), 2), "execute_median_ms": round(statistics.median(execute_ms), 3),
            "gen2_collections": collections[0], "steps_ms": [round(ms, 1) for ms in step_ms]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag")
    parser.add_argument("--no-graph-sampling", action="store_true")
    args = parser.parse_args()
    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps(harness.LLAMA_31_8B))
    engine, _ = harness.make_engine(model_dir, graph_sampling=not args.no_graph_sampling)
    rng = np.random.default_rng(0)
    result = {batch: step_times(engine, rng, batch, steps) for batch, steps in ((64, 48), (256, 32))}
    print(args.tag, json.dumps(result))


if __name__ == "__main__":
    main()
