"""Full graphs of prompt steps on the CPU (run without capture): the static buffers, padded to a bucket and to its
sequence slots, give the eager forward's hidden states and KV writes; the same greedy tokens through ModelRunner.
The graph-mode kernels themselves: test_kernels_triton_graph.py (interpreter) and tests/gpu."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.execution import RunnerConfig
from deepinfer.engine.full_graphs import FullGraphRunner, capture_full
from deepinfer.engine.runner import ModelRunner
from deepinfer.kernels import get_ops
from deepinfer.loader.hf import load_model
from deepinfer.testing.paged_cache import random_prompt as prompt
from tests.unit.test_piecewise_graphs import (  # noqa: F401 (the model fixture)
    BLOCK_SIZE,
    assert_kv_writes,
    generate,
    mixed_steps,
    model,
    paged,
)

CPU = torch.device("cpu")


def full_runner(model, kv_caches, tokens: int = 64, max_seqs: int = 6, logits: bool = True) -> FullGraphRunner:  # noqa: F811
    return FullGraphRunner(model, kv_caches, tokens, max_seqs, 128, BLOCK_SIZE, CPU, use_graphs=False,
                           logits=model.compute_logits if logits else None)


def last_rows(meta) -> list[int]:
    return [end - 1 for end in meta.query_start_loc_cpu[1:]]


@torch.no_grad()
def test_full_runner_over_padded_static_buffers_equals_the_eager_forward(model):  # noqa: F811
    """The sampled rows' hidden states, logits and greedy tokens equal the eager forward's (to 1e-5: padding changes
    the matmuls' row count); the padding rows write no KV, every real row's KV equals eager (so every row's
    layers do). Steps of 5, 3 and 2 sequences over 6 slots, buckets 32, 32 and 16 (stale rows above)."""
    cache = paged(model)
    steps = list(mixed_steps(model, cache))
    caches = [c.clone() for c in cache.kv_caches]
    runner = full_runner(model, caches)
    assert runner.buckets == [16, 32, 64] and runner.can_run(64) and not runner.can_run(65)
    assert [runner.attention.slots(n) for n in runner.buckets] == [6, 6, 6]
    for ids, positions, meta in steps:
        before = [c.clone() for c in caches]
        rows = last_rows(meta)[::-1]  # any order: the sampler's
        eager = model(ids, positions, cache.kv_caches, meta)[rows]
        step = runner.run(ids, positions, meta, rows)
        assert step.hidden.shape == eager.shape
        torch.testing.assert_close(step.hidden, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step.logits, model.compute_logits(eager), rtol=1e-5, atol=1e-5)
        assert torch.equal(step.greedy_token_ids, step.logits.argmax(-1))
        assert_kv_writes(caches, cache.kv_caches, before, meta.slot_mapping)
    assert runner.num_runs == 3


@torch.no_grad()
def test_static_layout_pads_slots_and_lists_the_prompt_tiles(model):  # noqa: F811
    cache = paged(model)
    ids, positions, meta = next(mixed_steps(model, cache))  # 5 sequences: q_lens 1, 1, 8, 5, 11 (26 tokens)
    runner = full_runner(model, cache.kv_caches)
    assert runner.run(ids, positions, meta, [25, 1]).hidden.shape[0] == 2
    assert runner.attention.sampled_rows(32).tolist() == [25, 1, 0, 0, 0, 0]
    graph_meta = runner.metas[32]
    assert graph_meta.query_start_loc.tolist() == [0, 1, 2, 10, 15, 26, 26]  # the sixth slot empty
    assert graph_meta.seq_lens.tolist() == [*meta.seq_lens_cpu, 0]
    tiles = graph_meta.prefill_tiles
    capacity = (tiles.shape[0] - 1) // 2
    assert tiles[0].item() == 3 and tiles[1:4].tolist() == [2, 3, 4] and tiles[1 + capacity : 4 + capacity].tolist() == [0, 0, 0]
    width = meta.block_tables.shape[1]
    assert torch.equal(graph_meta.block_tables[:5, :width], meta.block_tables)
    assert graph_meta.max_seq_len == 128 and graph_meta.max_query_len == 32


@pytest.mark.parametrize("logits", [False, True])
def test_model_runner_routes_prompt_steps_through_the_full_runner(model, logits):  # noqa: F811
    """ModelRunner.forward with a (CPU, uncaptured) full runner: the same greedy tokens as eager, with the runner's
    greedy tokens (logits) or the sampler's (no logits)."""
    vocab = model.config.vocab_size
    prompts = [prompt(n, seed=n, vocab_size=vocab) for n in (3, 17, 9, 30, 5)]

    def make_runner() -> ModelRunner:
        kv_caches = [torch.zeros(model.config.kv_cache_shape(96, BLOCK_SIZE)) for _ in model.model.layers]
        return ModelRunner(model, kv_caches, RunnerConfig(block_size=BLOCK_SIZE, vocab_size=vocab, device=CPU,
                                                          max_model_len=64, max_num_seqs=8))

    eager = generate(make_runner(), prompts, 6)
    runner = make_runner()
    runner.full_graphs = FullGraphRunner(model, runner.kv_caches, 24, 8, 64, BLOCK_SIZE, CPU, use_graphs=False,
                                         logits=model.compute_logits if logits else None)
    full_step, sampler_in_full_steps = [], []
    forward, run, sample = runner.forward, runner.full_graphs.run, runner.sampler.forward
    runner.forward = lambda *a, **k: full_step.clear() or forward(*a, **k)
    runner.full_graphs.run = lambda *a, **k: full_step.append(True) or run(*a, **k)
    runner.sampler.forward = lambda *a, **k: sampler_in_full_steps.append(bool(full_step)) or sample(*a, **k)
    assert generate(runner, prompts, 6) == eager
    assert runner.full_graphs.num_runs >= 3  # the steps with prompt rows (decode-only steps: eager on the CPU)
    # with the logits in the graph, its greedy tokens are the step's: no sampler launch
    assert any(sampler_in_full_steps) != logits and not all(sampler_in_full_steps)


def test_deepseek_has_no_full_graphs(tmp_path):
    from deepinfer.testing.checkpoints_deepseek import make_tiny_deepseek_checkpoint

    path = make_tiny_deepseek_checkpoint(tmp_path, "deepseek_v2", q_lora_rank=None)
    deepseek = load_model(path, torch.float32, CPU, get_ops("cpu"), progress=False)
    assert capture_full(deepseek, [], 2048, 8, 128, BLOCK_SIZE, CPU) is None
    with pytest.raises(ValueError, match="graph-mode attention"):
        FullGraphRunner(deepseek, [], 64, 8, 128, BLOCK_SIZE, CPU, use_graphs=False)


@pytest.mark.parametrize(("full", "sampling"), [(False, False), (True, False), (True, True)])
def test_prompt_graphs_capture_into_the_decode_graphs_pool_with_their_tail(monkeypatch, full, sampling):
    """ModelRunner's choice between full and piecewise graphs (captured on CUDA only: the capture is recorded here):
    the decode graphs' pool, sequence count and context length go to the full graphs, and with `sampling` their
    logits tail (graph_sampling)."""
    from deepinfer.engine import full_graphs
    from deepinfer.engine.cuda_graphs import CudaGraphRunner

    calls = []
    monkeypatch.setattr(full_graphs, "capture_full", lambda *a: calls.append(("full", a)) or "F")
    monkeypatch.setattr(full_graphs, "capture_piecewise", lambda *a: calls.append(("piecewise", a)) or "P")
    decode = CudaGraphRunner.__new__(CudaGraphRunner)  # the attributes a captured one has, on the CPU
    decode.static64, decode.max_bs, decode.max_model_len, decode.pool = torch.zeros(1), 8, 128, (0, 1)
    decode.compute_logits, decode.logits = len, torch.zeros(8, 5)
    got = full_graphs.capture_prompt_graphs("model", ["cache"], decode, 512, BLOCK_SIZE, full=full, sampling=sampling)
    if full:
        tail = (len, decode.logits) if sampling else (None, None)
        assert got == ("F", None)
        assert calls == [("full", ("model", ["cache"], 512, 8, 128, BLOCK_SIZE, CPU, (0, 1), *tail))]
    else:
        assert got == (None, "P") and calls == [("piecewise", ("model", ["cache"], 512, CPU, (0, 1)))]
