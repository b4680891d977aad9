"""Host time of one decode step on the CPU: Scheduler + the runner's input preparation + sampling + update,
with a fake model step (no GPU), at batch 256 and 2k tokens of context.

    PYTHONPATH=shared:. python bench/host_overhead.py [--batch 256] [--context 2048] [--steps 64]

The fake model returns tiny tensors at once, so what is timed is what the host adds to every step in series
with the GPU: schedule(), the runner's flat batch and staging (and the CUDA-graph input fill, done here into
host arrays), the sampler's host work on a small vocabulary, and update(). Prints ms per step and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.request import Request
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling.params import SamplingParams

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


class PhaseTimer:
    """Wraps bound methods of objects and sums the seconds spent in each (instance attributes shadow them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._wrapped: list[tuple[object, str]] = []

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

        setattr(owner, method, call)
        self._wrapped.append((owner, method))

    def reset(self) -> None:
        """Zero the sums."""
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def build(batch: int, context: int, block_size: int, max_tokens: int) -> tuple[Scheduler, ModelRunner]:
    """A scheduler holding `batch` running requests whose first `context` tokens are computed (as after a
    disaggregated prefill), and a CPU runner over the fake model."""
    max_model_len = 8192
    num_blocks = batch * (-(-(context + max_tokens + 1) // block_size)) + 1
    num_blocks = max(num_blocks, max_model_len // block_size + 1)
    config = EngineConfig(num_blocks=num_blocks, max_model_len=max_model_len, block_size=block_size,
                          max_num_seqs=batch, max_num_batched_tokens=2048, enable_kv_events=False)
    scheduler = Scheduler(config)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    for i in range(batch):
        request = Request(f"r{i}", rng.integers(0, VOCAB, context + 1).tolist(), params, eos_token_ids=(1,))
        assert scheduler.add_prefilled_request(request, context) is not None
        scheduler.commit_prefilled(request.request_id)
    runner = ModelRunner(FakeModel(), [], block_size, VOCAB, torch.device("cpu"), (1,),
                         max_model_len=max_model_len, max_num_seqs=batch)
    return scheduler, runner


def step(scheduler: Scheduler, runner: ModelRunner) -> None:
    """One engine step as EngineCore.step runs it."""
    output = scheduler.schedule()
    sampled = runner.execute(output, scheduler.requests)
    scheduler.update(output, {rid: [s.token_id] for rid, s in sampled.items()})


def measure(batch: int, context: int, steps: int, block_size: int = 16) -> dict:
    """Median ms per step (over repeats of `steps` steps) and the mean split by phase."""
    torch.set_num_threads(1)
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
    per_step = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            step(scheduler, runner)
        per_step.append((time.perf_counter() - start) / steps)
    phases = {name: round(1e3 * s / (3 * steps), 3) for name, s in timer.seconds.items()}
    phases["sample+rest_of_execute"] = round(phases.pop("execute") - phases["prepare"] - phases["stage"], 3)
    fill_ms = graph_fill_ms(scheduler, runner, steps)
    return {"batch": batch, "context": context, "step_ms": round(1e3 * statistics.median(per_step), 3),
            "phases_ms": phases, "graph_fill_ms": fill_ms}


def graph_fill_ms(scheduler: Scheduler, runner: ModelRunner, steps: int) -> float:
    """Host ms of filling the CUDA graph's static inputs for the next step (host arrays only, no copy)."""
    from deepinfer.engine.cuda_graphs import GraphInputs, capture_sizes, padded_batch_size

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


def main() -> None:
    """Print ms per step by phase, then one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    res = measure(args.batch, args.context, args.steps)
    print(f"host ms/step at B={res['batch']}, context {res['context']}: {res['step_ms']}  "
          f"phases {res['phases_ms']}  graph input fill {res['graph_fill_ms']}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
