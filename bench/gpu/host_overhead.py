"""Host time of one decode step on the CPU: Scheduler + the runner's input preparation + sampling + update,
with a fake model step (no GPU), at batch 256 and 2k tokens of context.

    PYTHONPATH=shared:. python bench/gpu/host_overhead.py [--batch 256] [--context 2048] [--steps 64] [--async]

The fake model returns tiny tensors at once, so what is timed is what the host adds to every step in series
with the GPU: schedule(), the runner's flat batch and staging (and the CUDA-graph input fill, done here into
host arrays), the sampler's host work on a small vocabulary, and update(). Prints ms per step and one JSON line
(`step_cpu_ms`: the process's CPU time per step, which time taken by other processes on a shared machine leaves out).

`--async`: EngineCore.step itself with async scheduling, as on one CUDA device: AsyncScheduler, execute_async
(decode steps through CudaGraphRunner.run over host buffers: GraphInputs.fill, the input copy as a CPU copy, a
no-op replay), finish_in_flight and the host tier's per-step offload check. "without sampling" leaves out
the runner's SamplingMetadataBuilder.build and the sampler. Both modes gc.freeze() the start-up objects first, as the worker does.
The fake model and the CPU graph runner: deepinfer.testing.cpu_graph_engine (tests/unit/test_cpu_graph_engine.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from deepinfer.engine.cuda_graphs import GraphInputs, capture_sizes
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import Scheduler
from deepinfer.testing.cpu_graph_engine import build, build_async_engine, step

#: The requests' temperature (--temperature): 0 = greedy; above, every row samples at random (seeded).
TEMPERATURE = 0.0


class PhaseTimer:
    """Wraps bound methods of objects and sums the seconds spent in each (instance attributes shadow them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._wrapped: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, method: str, phase: str) -> None:
        """Time every call of owner.method under `phase`."""
        original = getattr(owner, method)
        self.seconds.setdefault(phase, 0.0)

        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        saved = vars(owner).get(method)
        setattr(owner, method, call)
        self._wrapped.append((owner, method, saved))

    def reset(self) -> None:
        """Zero the sums."""
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def restore(self) -> None:
        """Put the wrapped methods back (a class's own attribute as it was; an instance's: the class's again)."""
        for owner, method, saved in reversed(self._wrapped):
            if saved is None:
                delattr(owner, method)
            else:
                setattr(owner, method, saved)
        self._wrapped = []


def freeze_start_up_objects() -> None:
    """As the worker does once its engine is loaded (deepinfer.worker.runtime): what exists now stays out of every
    later collection, so a full collection walks only what the steps keep alive (requests, their token lists)."""
    gc.collect()
    gc.freeze()


def measure(batch: int, context: int, steps: int, block_size: int = 16) -> dict:
    """Median ms per step (over repeats of `steps` steps) and the mean split by phase."""
    torch.set_num_threads(1)
    freeze_start_up_objects()
    scheduler, runner = build(batch, context, block_size, max_tokens=4 * steps + 32, temperature=TEMPERATURE)
    timer = PhaseTimer()
    timer.wrap(scheduler, "schedule", "schedule")
    timer.wrap(scheduler, "update_sampled", "update")
    timer.wrap(runner, "execute", "execute")
    timer.wrap(runner, "prepare_batch", "prepare")
    timer.wrap(runner.stager, "stage", "stage")
    for _ in range(3):
        step(scheduler, runner)
    timer.reset()
    per_step, cpu_per_step = [], []
    for _ in range(3):
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step(scheduler, runner)
        per_step.append((time.perf_counter() - start) / steps)
        cpu_per_step.append((time.process_time() - cpu_start) / steps)
    phases = {name: round(1e3 * s / (3 * steps), 3) for name, s in timer.seconds.items()}
    phases["sample+rest_of_execute"] = round(phases.pop("execute") - phases["prepare"] - phases["stage"], 3)
    fill_ms = graph_fill_ms(scheduler, runner, steps)
    return {"batch": batch, "context": context, "step_ms": round(1e3 * statistics.median(per_step), 3),
            "step_cpu_ms": round(1e3 * statistics.median(cpu_per_step), 3), "phases_ms": phases,
            "graph_fill_ms": fill_ms}


def graph_fill_ms(scheduler: Scheduler, runner: ModelRunner, steps: int) -> float:
    """Host ms of filling the CUDA graph's static inputs for the next step (host arrays only, no copy)."""
    from deepinfer.engine.cuda_graphs import padded_batch_size

    graph_inputs = GraphInputs(runner.max_num_seqs, runner.block_table.max_blocks_per_seq)
    output = scheduler.schedule()
    batch = runner.prepare_batch(output)
    bs = padded_batch_size(capture_sizes(runner.max_num_seqs), batch.num_seqs)
    start = time.perf_counter()
    for _ in range(steps):
        graph_inputs.fill(batch, runner.block_table, bs)
    elapsed = (time.perf_counter() - start) / steps
    scheduler.update(output, {s.request_id: [2] for s in output.scheduled})
    return round(1e3 * elapsed, 3)


def measure_async(batch: int, context: int, steps: int, block_size: int = 16, graph_sampling: bool = True) -> dict:
    """As measure(), for EngineCore.step with async scheduling; phases as the profile names them. With
    graph_sampling (the default on CUDA) the greedy steps take the graph's tokens: no metadata, no sampler."""
    torch.set_num_threads(1)
    freeze_start_up_objects()
    core = build_async_engine(batch, context, block_size, max_tokens=4 * steps + 32, graph_sampling=graph_sampling,
                              temperature=TEMPERATURE)
    runner = core.runner
    timer = PhaseTimer()
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.scheduler, "update_sampled", "update")
    timer.wrap(runner, "execute_async", "execute_async")
    timer.wrap(runner, "prepare_batch", "prepare")
    timer.wrap(runner.graphs, "run", "graph_run")
    timer.wrap(runner.graphs.inputs, "fill", "graph_fill")
    timer.wrap(runner.sampling_metadata, "build", "sampling_metadata")
    timer.wrap(runner, "sampler", "sampler")
    timer.wrap(core, "finish_in_flight", "finish_in_flight")
    timer.wrap(core.host_tier, "offload", "host_tier_offload")
    try:
        for _ in range(3):
            core.step()
        timer.reset()
        per_step, cpu_per_step = [], []
        for _ in range(3):
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(steps):
                core.step()
            per_step.append((time.perf_counter() - start) / steps)
            cpu_per_step.append((time.process_time() - cpu_start) / steps)
        replays = runner.graphs.num_replays
    finally:
        timer.restore()
    assert replays >= 3 * steps, replays  # every decode step went through the graph runner
    phases = {name: round(1e3 * s / (3 * steps), 3) for name, s in timer.seconds.items()}
    rest = phases["execute_async"] - phases["prepare"] - phases["graph_run"] - phases["sampling_metadata"]
    phases["rest_of_execute_async"] = round(rest - phases["sampler"], 3)
    phases["rest_of_finish"] = round(phases["finish_in_flight"] - phases["update"], 3)
    step_ms = 1e3 * statistics.median(per_step)
    return {"mode": "async", "batch": batch, "context": context, "graph_sampling": graph_sampling,
            "step_ms": round(step_ms, 3),
            "step_cpu_ms": round(1e3 * statistics.median(cpu_per_step), 3),
            "step_ms_without_sampling": round(step_ms - phases["sampling_metadata"] - phases["sampler"], 3),
            "phases_ms": phases}


def main() -> None:
    """Print ms per step by phase, then one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--async", dest="async_mode", action="store_true",
                        help="EngineCore.step with async scheduling and the CUDA-graph path's host work")
    parser.add_argument("--no-graph-sampling", action="store_true",
                        help="--async: the graphs end at the hidden states; the sampler runs every step")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the requests' temperature (default 0: greedy; above 0 every row samples at random)")
    args = parser.parse_args()
    global TEMPERATURE
    TEMPERATURE = args.temperature
    if args.async_mode:
        res = measure_async(args.batch, args.context, args.steps, graph_sampling=not args.no_graph_sampling)
        print(f"async host ms/step at B={res['batch']}, context {res['context']}: {res['step_ms']} "
              f"(without sampling {res['step_ms_without_sampling']})  phases {res['phases_ms']}")
    else:
        res = measure(args.batch, args.context, args.steps)
        print(f"host ms/step at B={res['batch']}, context {res['context']}: {res['step_ms']}  "
              f"phases {res['phases_ms']}  graph input fill {res['graph_fill_ms']}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
