"""Host time of one decode step on the CPU: Scheduler + the runner's input preparation + sampling + update,
with a fake model step (no GPU), at batch 256 and 2k tokens of context.

    PYTHONPATH=shared:. python bench/host_overhead.py [--batch 256] [--context 2048] [--steps 64] [--async]

The fake model returns tiny tensors at once, so what is timed is what the host adds to every step in series
with the GPU: schedule(), the runner's flat batch and staging (and the CUDA-graph input fill, done here into
host arrays), the sampler's host work on a small vocabulary, and update(). Prints ms per step and one JSON line
(`step_cpu_ms`: the process's CPU time per step, which time taken by other processes on a shared machine leaves out).

`--async`: EngineCore.step itself with async scheduling, as on one CUDA device: AsyncScheduler, execute_async
(decode steps through CudaGraphRunner.run over host buffers: GraphInputs.fill, the input copy as a CPU copy, a
no-op replay), _finish_in_flight and the host tier's per-step offload check. "without sampling" leaves out
the runner's SamplingMetadataBuilder.build and the sampler. Both modes gc.freeze() the start-up objects first, as the worker does.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time

import numpy as np
import torch

from deepinfer.engine.async_scheduler import AsyncScheduler
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.core import EngineCore
from deepinfer.engine.cuda_graphs import (
    CudaGraphRunner,
    GraphInputs,
    GraphStep,
    capture_sizes,
    seq_len_buckets,
)
from deepinfer.engine.execution import RunnerConfig
from deepinfer.engine.host_tier import OFFLOAD_BATCH_BLOCKS, OFFLOAD_MAX_STEPS, HostTier
from deepinfer.engine.request import Request
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.sampler import greedy_tokens

VOCAB, HIDDEN = 64, 8
#: The requests' temperature (--temperature): 0 = greedy; above, every row samples at random (seeded).
TEMPERATURE = 0.0


class FakeModel(torch.nn.Module):
    """A model step that costs nothing: hidden [T, HIDDEN] zeros, logits [S, VOCAB] from a fixed generator."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Hidden states of every row."""
        return torch.zeros(input_ids.shape[0], HIDDEN)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Random logits of the sampled rows."""
        return torch.randn(hidden.shape[0], VOCAB, generator=self.generator)


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


def build(
    batch: int, context: int, block_size: int, max_tokens: int, scheduler_class: type[Scheduler] = Scheduler
) -> tuple[Scheduler, ModelRunner]:
    """A scheduler holding `batch` running requests whose first `context` tokens are computed (as after a
    disaggregated prefill), and a CPU runner over the fake model."""
    max_model_len = 8192
    num_blocks = batch * (-(-(context + max_tokens + 1) // block_size)) + 1
    num_blocks = max(num_blocks, max_model_len // block_size + 1)
    config = EngineConfig(num_blocks=num_blocks, max_model_len=max_model_len, block_size=block_size,
                          max_num_seqs=batch, max_num_batched_tokens=2048, enable_kv_events=False)
    scheduler = scheduler_class(config)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens, ignore_eos=True, seed=0)
    for i in range(batch):
        request = Request(f"r{i}", rng.integers(0, VOCAB, context + 1).tolist(), params, eos_token_ids=(1,))
        assert scheduler.add_prefilled_request(request, context) is not None
        scheduler.commit_prefilled(request.request_id)
    runner = ModelRunner(FakeModel(), [], RunnerConfig(block_size=block_size, vocab_size=VOCAB,
                                                       device=torch.device("cpu"), eos_token_ids=(1,),
                                                       max_model_len=max_model_len, max_num_seqs=batch))
    return scheduler, runner


def step(scheduler: Scheduler, runner: ModelRunner) -> None:
    """One engine step as EngineCore.step runs it."""
    output = scheduler.schedule()
    sampled = runner.execute(output, scheduler.requests)
    scheduler.update(output, {rid: [s.token_id] for rid, s in sampled.items()})


def freeze_start_up_objects() -> None:
    """As the worker does once its engine is loaded (deepinfer.worker.runtime): what exists now stays out of every
    later collection, so a full collection walks only what the steps keep alive (requests, their token lists)."""
    gc.collect()
    gc.freeze()


def measure(batch: int, context: int, steps: int, block_size: int = 16) -> dict:
    """Median ms per step (over repeats of `steps` steps) and the mean split by phase."""
    torch.set_num_threads(1)
    freeze_start_up_objects()
    scheduler, runner = build(batch, context, block_size, max_tokens=4 * steps + 32)
    timer = PhaseTimer()
    timer.wrap(scheduler, "schedule", "schedule")
    timer.wrap(scheduler, "update", "update")
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


class _NoOpGraph:
    """Stands in for a captured CUDA graph: replay() costs only the call."""

    def replay(self) -> None:
        """Nothing to run on the CPU."""


class _GreedyTailGraph:
    """Stands in for a decode graph that computes the logits and greedy tokens (graph_sampling): replay() runs
    the tail on the CPU into the step's static outputs (the forward itself costs nothing here)."""

    def __init__(self, model: torch.nn.Module, step: GraphStep) -> None:
        self.model, self.step = model, step

    def replay(self) -> None:
        """The captured tail: logits into the static buffer, each row's argmax and its logprob."""
        step = self.step
        step.logits.copy_(self.model.compute_logits(step.hidden))
        token_ids, logprobs = greedy_tokens(step.logits)
        step.greedy_token_ids.copy_(token_ids)
        step.greedy_logprobs.copy_(logprobs)


class _NoOpEvent:
    """Stands in for torch.cuda.Event: the CPU copies are done when issued."""

    def record(self) -> None:
        """Nothing to record."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


def cpu_graph_runner(runner: ModelRunner, max_model_len: int, graph_sampling: bool = True) -> CudaGraphRunner:
    """A CudaGraphRunner whose device buffers are CPU tensors and whose graphs are no-ops (with graph_sampling:
    they compute the logits and greedy tokens, as the captured tail does): its run() does the host work of a
    replay (GraphInputs.fill, the static-input copies, the placeholder fill) for real."""
    graphs = CudaGraphRunner.__new__(CudaGraphRunner)
    graphs.model, graphs.kv_caches, graphs.block_size = runner.model, [], runner.block_size
    graphs.max_model_len, graphs.sizes = max_model_len, capture_sizes(runner.max_num_seqs)
    graphs.seq_len_buckets = seq_len_buckets(max_model_len)
    graphs.max_bs, graphs.width = graphs.sizes[-1], -(-max_model_len // runner.block_size)
    graphs.inputs = GraphInputs(graphs.max_bs, graphs.width)
    graphs.static64 = torch.zeros(graphs.inputs.host64.shape, dtype=torch.int64)
    graphs.static32 = torch.zeros(graphs.inputs.host32.numel(), dtype=torch.int32)
    keys = [(bs, bucket) for bs in graphs.sizes for bucket in graphs.seq_len_buckets]
    graphs.compute_logits = runner.model.compute_logits if graph_sampling else None
    graphs.logits = torch.zeros(graphs.max_bs, VOCAB) if graph_sampling else None
    graphs.outputs, graphs.graphs = {}, {}
    for key in keys:
        bs = key[0]
        if graph_sampling:
            step = GraphStep(torch.zeros(bs, HIDDEN), graphs.logits[:bs], torch.zeros(bs, dtype=torch.int64),
                             torch.zeros(bs))
            graphs.outputs[key], graphs.graphs[key] = step, _GreedyTailGraph(runner.model, step)
        else:
            graphs.outputs[key] = GraphStep(torch.zeros(bs, HIDDEN), None, None, None)
            graphs.graphs[key] = _NoOpGraph()
    graphs.num_replays, graphs._copied = 0, _NoOpEvent()
    graphs._step_views = {}
    graphs._capture_context = contextlib.nullcontext()
    return graphs


def build_async_engine(batch: int, context: int, block_size: int, max_tokens: int,
                       graph_sampling: bool = True) -> EngineCore:
    """An EngineCore (no model load) over the async scheduler, the CPU graph runner and a host tier batching its
    offloads as on CUDA (tiny KV caches: one layer, one head of HIDDEN)."""
    scheduler, runner = build(batch, context, block_size, max_tokens, AsyncScheduler)
    runner.graphs = cpu_graph_runner(runner, scheduler.config.max_model_len, graph_sampling)
    kv = torch.zeros(2, scheduler.config.num_blocks, block_size, 1, HIDDEN, dtype=torch.float16)
    host_tier = HostTier([kv], 4 * scheduler.config.num_blocks, scheduler.block_pool)
    host_tier.offload_batch_blocks, host_tier.offload_max_steps = OFFLOAD_BATCH_BLOCKS, OFFLOAD_MAX_STEPS
    core = EngineCore.__new__(EngineCore)
    core.scheduler, core.runner, core.host_tier = scheduler, runner, host_tier
    core.async_scheduling, core._in_flight = True, None
    return core


def measure_async(batch: int, context: int, steps: int, block_size: int = 16, graph_sampling: bool = True) -> dict:
    """As measure(), for EngineCore.step with async scheduling; phases as the profile names them. With
    graph_sampling (the default on CUDA) the greedy steps take the graph's tokens: no metadata, no sampler."""
    torch.set_num_threads(1)
    freeze_start_up_objects()
    core = build_async_engine(batch, context, block_size, max_tokens=4 * steps + 32, graph_sampling=graph_sampling)
    runner = core.runner
    timer = PhaseTimer()
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.scheduler, "update", "update")
    timer.wrap(runner, "execute_async", "execute_async")
    timer.wrap(runner, "prepare_batch", "prepare")
    timer.wrap(runner.graphs, "run", "graph_run")
    timer.wrap(runner.graphs.inputs, "fill", "graph_fill")
    timer.wrap(runner.sampling_metadata, "build", "sampling_metadata")
    timer.wrap(runner, "sampler", "sampler")
    timer.wrap(core, "_finish_in_flight", "finish_in_flight")
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
