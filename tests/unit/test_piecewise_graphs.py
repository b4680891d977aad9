"""Piecewise graphs on the CPU: the block split at attention is the old forward bit for bit, and the runner's
static buffers and padding (pieces run without capture) give the eager forward's hidden states and KV writes."""

from __future__ import annotations

import functools

import pytest
import torch

from deepinfer.distributed.parallel_state import TensorParallelGroup
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.execution import RunnerConfig
from deepinfer.engine.piecewise_graphs import (
    PiecewiseGraphRunner,
    capture_piecewise,
    supports_piecewise,
    token_buckets,
)
from deepinfer.engine.request import Request
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kernels import get_ops
from deepinfer.loader.hf import load_model
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.sampling.params import SamplingParams
from deepinfer.testing.checkpoints import make_tiny_checkpoint
from deepinfer.testing.paged_cache import PagedCache
from deepinfer.testing.paged_cache import random_prompt as prompt

BLOCK_SIZE = 4
paged = functools.partial(PagedCache.for_model, num_blocks=128, block_size=BLOCK_SIZE)


@pytest.fixture(scope="module", params=["llama", "qwen3", "mistral"])
def model(request, tmp_path_factory):
    torch.set_num_threads(1)
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(path, torch.float32, torch.device("cpu"), get_ops("cpu"), progress=False)


def unsplit_forward(model, input_ids, positions, kv_caches, meta):
    """The decoder forward as it was before the split at attention (the reference op order)."""
    stack = model.model
    hidden, residual = stack.embed_tokens(input_ids), None
    for layer, kv_cache in zip(stack.layers, kv_caches, strict=True):
        if residual is None:
            residual, hidden = hidden, layer.input_layernorm(hidden)
        else:
            hidden, residual = layer.input_layernorm(hidden, residual)
        attn, num_tokens = layer.self_attn, hidden.shape[0]
        q, k, v = attn.qkv_proj(hidden).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(num_tokens, attn.num_heads, attn.head_dim)
        k = k.reshape(num_tokens, attn.num_kv_heads, attn.head_dim)
        v = v.reshape(num_tokens, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            q = attn.q_norm(q.reshape(-1, attn.head_dim)).view_as(q)
            k = attn.k_norm(k.reshape(-1, attn.head_dim)).view_as(k)
        q, k = attn.rotary(positions, q, k)
        attn.ops.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        out = attn.ops.paged_attention(q, kv_cache, meta, attn.scale, attn.sliding_window)
        hidden = attn.o_proj(out.reshape(num_tokens, attn.q_size))
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(hidden)
    hidden, _ = stack.norm(hidden, residual)
    return hidden


def mixed_steps(model, cache):
    """Prefill three sequences eagerly, then yield two mixed steps (decode rows, a chunk over a cached prefix and
    new prompts of different lengths) as (input_ids, positions, metadata)."""
    vocab = model.config.vocab_size
    for seq, length in ((0, 6), (1, 9), (2, 4)):
        cache.step(model, [(seq, prompt(length, seed=seq, vocab_size=vocab), 0)])
    yield cache.inputs([(0, [7], 6), (1, [8], 9), (2, prompt(8, 2, vocab), 4), (3, prompt(5, 3, vocab), 0),
                        (4, prompt(11, 4, vocab), 0)])  # 26 tokens: bucket 32
    yield cache.inputs([(0, [9], 7), (4, [5], 11), (5, prompt(30, 5, vocab), 0)])  # 32 tokens: a full bucket
    yield cache.inputs([(1, [3], 10), (3, prompt(4, 6, vocab), 5)])  # 5 tokens: bucket 16, stale rows above


@torch.no_grad()
def test_split_block_is_the_unsplit_forward_bit_for_bit(model):
    cache = paged(model)
    ids, positions, meta = cache.inputs([(0, prompt(13, 0, model.config.vocab_size), 0)])
    ref_caches = [c.clone() for c in cache.kv_caches]
    ref = unsplit_forward(model, ids, positions, ref_caches, meta)
    assert torch.equal(model(ids, positions, cache.kv_caches, meta), ref)
    assert all(torch.equal(a, b) for a, b in zip(cache.kv_caches, ref_caches, strict=True))
    # ... and so is driving the halves one by one, as the piecewise runner does.
    stack, hidden, residual = model.model, model.model.embed(ids), None
    for layer, kv_cache in zip(stack.layers, [c.clone() for c in ref_caches], strict=True):
        q, residual = layer.before_attention(positions, hidden, residual, kv_cache, meta)
        hidden, residual = layer.after_attention(layer.self_attn.attend(q, kv_cache, meta), residual)
    assert torch.equal(stack.final_norm(hidden, residual), ref)


@torch.no_grad()
def test_piecewise_pieces_over_padded_static_buffers_equal_the_eager_forward(model):
    """Real rows equal the eager forward's; the padding rows write no KV (slots outside the step's unchanged).

    Equal to 1e-5, not bit for bit (though they are on this machine): padding changes the matmuls' row count, and
    a BLAS may pick another kernel for it on another CPU. A wrong row, a stale buffer or a lost residual is O(1)."""
    cache = paged(model)
    steps = list(mixed_steps(model, cache))  # prefills the first sequences; then only slots are handed out
    piecewise_caches = [c.clone() for c in cache.kv_caches]
    runner = PiecewiseGraphRunner(model, piecewise_caches, 64, torch.device("cpu"), use_graphs=False)
    runner.capture()
    assert runner.buckets == [16, 32, 64] and runner.num_graphs == 0
    for ids, positions, meta in steps:
        before = [c.clone() for c in piecewise_caches]
        eager = model(ids, positions, cache.kv_caches, meta)
        hidden = runner.run(ids, positions, meta)
        assert hidden.shape == eager.shape
        torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)
        assert_kv_writes(piecewise_caches, cache.kv_caches, before, meta.slot_mapping)
    assert runner.num_runs == 3


def assert_kv_writes(caches, eager_caches, before, slot_mapping) -> None:
    """The step's slots hold the eager forward's K/V (to 1e-5); every other slot is as it was `before`."""
    written = torch.zeros(caches[0][0].view(-1, *caches[0].shape[3:]).shape[0], dtype=bool)
    written[slot_mapping] = True
    for ours, eagers, old in zip(caches, eager_caches, before, strict=True):
        ours, eagers, old = (c.view(2, -1, *c.shape[3:]) for c in (ours, eagers, old))
        assert torch.equal(ours[:, ~written], old[:, ~written]), "a padding row wrote KV"
        torch.testing.assert_close(ours[:, written], eagers[:, written], rtol=1e-5, atol=1e-5)


def test_token_buckets():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 384, 512, 768, 1000]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(16384) == token_buckets(4096) == [*token_buckets(2048), *range(2304, 4097, 256)]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        token_buckets(0)


def test_runner_takes_only_steps_within_its_largest_bucket(model):
    runner = PiecewiseGraphRunner(model, paged(model).kv_caches, 48, torch.device("cpu"), use_graphs=False)
    assert not runner.can_run(10)  # not captured yet
    runner.capture()
    assert runner.can_run(1) and runner.can_run(48) and not runner.can_run(49) and not runner.can_run(0)
    assert runner.bucket(33) == 48 and runner.bucket(49) is None


def test_only_single_rank_llama_family_models_take_the_piecewise_path(model, tmp_path):
    assert supports_piecewise(model)
    sharded = LlamaForCausalLM(model.config, get_ops("cpu"), TensorParallelGroup(rank=0, world_size=2))
    assert not supports_piecewise(sharded)
    assert not supports_piecewise(torch.nn.Identity())
    with pytest.raises(ValueError, match="no piecewise forward"):
        PiecewiseGraphRunner(sharded, [], 64, torch.device("cpu"), use_graphs=False)


def test_deepseek_keeps_the_eager_path(tmp_path):
    from deepinfer.testing.checkpoints_deepseek import make_tiny_deepseek_checkpoint

    path = make_tiny_deepseek_checkpoint(tmp_path, "deepseek_v2", q_lora_rank=None)
    deepseek = load_model(path, torch.float32, torch.device("cpu"), get_ops("cpu"), progress=False)
    assert not supports_piecewise(deepseek)
    assert capture_piecewise(deepseek, [], 2048, torch.device("cpu")) is None  # the runner's check: eager, no error


def generate(runner: ModelRunner, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt through Scheduler + runner, with a small token budget (mixed steps)."""
    config = EngineConfig(num_blocks=96, max_model_len=64, block_size=BLOCK_SIZE, max_num_seqs=8,
                          max_num_batched_tokens=24)
    scheduler = Scheduler(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    for i, token_ids in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", token_ids, params, arrival_time=float(i)))
    tokens: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        sampled = runner.execute(output, scheduler.requests)
        for rid, s in sampled.items():
            tokens.setdefault(rid, []).append(s.token_id)
        scheduler.update(output, {rid: [s.token_id] for rid, s in sampled.items()})
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_model_runner_routes_prompt_steps_through_the_pieces(model):
    """ModelRunner.forward with a (CPU, uncaptured) piecewise runner: the same greedy tokens as eager."""
    vocab = model.config.vocab_size
    prompts = [prompt(n, seed=n, vocab_size=vocab) for n in (3, 17, 9, 30, 5)]

    def make_runner() -> ModelRunner:
        kv_caches = [torch.zeros(model.config.kv_cache_shape(96, BLOCK_SIZE)) for _ in model.model.layers]
        return ModelRunner(model, kv_caches, RunnerConfig(block_size=BLOCK_SIZE, vocab_size=vocab,
                                                          device=torch.device("cpu"), max_model_len=64, max_num_seqs=8))

    eager = generate(make_runner(), prompts, 6)
    runner = make_runner()
    runner.piecewise = PiecewiseGraphRunner(model, runner.kv_caches, 24, torch.device("cpu"), use_graphs=False)
    runner.piecewise.capture()
    assert generate(runner, prompts, 6) == eager
    assert runner.piecewise.num_runs >= 3  # the steps with prompt rows (decode-only steps: eager on the CPU)


def test_async_placeholders_are_filled_before_the_pieces_read_the_input_ids(tiny_dir):
    """Async scheduling feeds the previous step's tokens as placeholders, filled on the device into the staged
    input_ids: steps with placeholders beside prompt rows, through the (uncaptured) pieces, give the sync tokens."""
    from deepinfer import LLM

    prompts = [{"prompt_token_ids": prompt(n, seed=n, vocab_size=300)} for n in (3, 17, 9, 30, 5, 22)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(str(tiny_dir), block_size=BLOCK_SIZE, max_num_batched_tokens=24, progress=False,
               async_scheduling=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_dir), block_size=BLOCK_SIZE, max_num_batched_tokens=24, progress=False, async_scheduling=True)
    runner = llm.engine.core.runner
    runner.piecewise = PiecewiseGraphRunner(runner.model, runner.kv_caches, 24, torch.device("cpu"), use_graphs=False)
    runner.piecewise.capture()
    filled, fill = [], runner._fill_placeholders

    def counted(batch, input_ids):
        filled.append(not batch.is_decode_only)
        return fill(batch, input_ids)

    runner._fill_placeholders = counted
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert any(filled), "no step mixed placeholders with prompt rows"
