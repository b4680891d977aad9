"""An engine over a fake model on the CPU that still takes the CUDA-graph runner's host path: the scheduler, the
runner's input preparation, sampling and update run for real, the model step and the graph replays cost nothing.

Used by bench/gpu/host_overhead.py (host time of a decode step) and tests/unit/test_cpu_graph_engine.py.
"""

from __future__ import annotations

import contextlib

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


def build(
    batch: int, context: int, block_size: int, max_tokens: int, scheduler_class: type[Scheduler] = Scheduler,
    temperature: float = 0.0,
) -> tuple[Scheduler, ModelRunner]:
    """A scheduler holding `batch` running requests whose first `context` tokens are computed (as after a
    disaggregated prefill), and a CPU runner over the fake model (temperature 0: greedy; above, every row
    samples at random, seeded)."""
    max_model_len = 8192
    num_blocks = batch * (-(-(context + max_tokens + 1) // block_size)) + 1
    num_blocks = max(num_blocks, max_model_len // block_size + 1)
    config = EngineConfig(num_blocks=num_blocks, max_model_len=max_model_len, block_size=block_size,
                          max_num_seqs=batch, max_num_batched_tokens=2048, enable_kv_events=False)
    scheduler = scheduler_class(config)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
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
    scheduler.update_sampled(output, runner.execute(output, scheduler.requests))


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
                       graph_sampling: bool = True, temperature: float = 0.0) -> EngineCore:
    """An EngineCore (no model load) over the async scheduler, the CPU graph runner and a host tier batching its
    offloads as on CUDA (tiny KV caches: one layer, one head of HIDDEN)."""
    scheduler, runner = build(batch, context, block_size, max_tokens, AsyncScheduler, temperature)
    runner.graphs = cpu_graph_runner(runner, scheduler.config.max_model_len, graph_sampling)
    kv = torch.zeros(2, scheduler.config.num_blocks, block_size, 1, HIDDEN, dtype=torch.float16)
    host_tier = HostTier([kv], 4 * scheduler.config.num_blocks, scheduler.block_pool)
    host_tier.offload_batch_blocks, host_tier.offload_max_steps = OFFLOAD_BATCH_BLOCKS, OFFLOAD_MAX_STEPS
    core = EngineCore.__new__(EngineCore)
    core.scheduler, core.runner, core.host_tier = scheduler, runner, host_tier
    core.async_scheduling, core._in_flight, core.drafter = True, None, None
    return core
