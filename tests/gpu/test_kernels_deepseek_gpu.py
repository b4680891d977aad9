"""Parity of the compiled DeepSeek Triton kernels (fused MoE, MLA decode) with their torch twins on CUDA.

DeepSeek-V2-Lite shapes: 64 routed experts top-6, hidden 2048, moe_intermediate 1408; MLA with
kv_lora_rank 512 + rope 64 and 16 heads, a decode batch of 64 at a 2k context. Self-contained like
test_kernels_gpu.py (`PYTHONPATH=shared python -m pytest tests/gpu -q --noconftest`).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import build_attention_metadata, get_ops, torch_mla, torch_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
NUM_EXPERTS, TOP_K, HIDDEN_SIZE, INTER_SIZE = 64, 6, 2048, 1408
NUM_HEADS, KV_LORA_RANK, ROPE_DIM = 16, 512, 64


@pytest.fixture(scope="module")
def triton_ops():
    """The Triton implementations, compiled for the device (imported here so CPU collection stays light)."""
    from deepinfer.kernels import triton_ops

    return triton_ops


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """|a - e| <= rtol * (|e| + max|e|): relative to the value, with a floor at the tensor's own scale."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol = RTOL[expected.dtype]
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)


def make_moe(num_tokens: int, dtype: torch.dtype, seed: int = 0):
    """Random experts and softmax top-k routing skewed towards low expert ids; expert 7 gets no tokens."""
    torch.manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN_SIZE, device="cuda").to(dtype)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTER_SIZE, HIDDEN_SIZE, device="cuda") * HIDDEN_SIZE**-0.5).to(dtype)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN_SIZE, INTER_SIZE, device="cuda") * INTER_SIZE**-0.5).to(dtype)
    scores = torch.randn(num_tokens, NUM_EXPERTS, device="cuda") - torch.arange(NUM_EXPERTS, device="cuda") * 0.05
    scores[:, 7] = float("-inf")
    topk_weights, topk_ids = torch.softmax(scores, dim=-1).topk(TOP_K, dim=-1)
    return hidden, w13, w2, topk_weights.float(), topk_ids


@pytest.mark.parametrize("num_tokens", [1, 64, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_matches_twin(triton_ops, num_tokens, dtype):
    hidden, w13, w2, topk_weights, topk_ids = make_moe(num_tokens, dtype)
    out = triton_ops.fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    assert_close(out, torch_moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids))


@pytest.mark.parametrize("num_tokens", [2, 64, 170])
def test_one_program_alignment_equals_the_sorting_one(triton_ops, num_tokens):
    from deepinfer.kernels import triton_moe

    *_, topk_ids = make_moe(num_tokens, torch.bfloat16, seed=num_tokens)
    for block_m in (16, 32):
        expected = triton_moe.align_pairs_to_blocks(topk_ids, NUM_EXPERTS, block_m)
        actual = triton_moe.align_pairs_one_program(topk_ids, NUM_EXPERTS, block_m)
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


def make_latent_batch(seq_lens, block_size, dtype, seed=0):
    """Random latent cache (every slot filled), shuffled block tables, absorbed decode queries on the GPU."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_tables, slot_mapping, used = [], [], 0
    for seq_len, n in zip(seq_lens, blocks_per_seq, strict=True):
        table = perm[used : used + n]
        used += n
        block_tables.append(table)
        slot_mapping.append(table[(seq_len - 1) // block_size] * block_size + (seq_len - 1) % block_size)
    meta = build_attention_metadata([1] * len(seq_lens), seq_lens, block_tables, slot_mapping, device="cuda")
    torch.manual_seed(seed)
    latent_dim = KV_LORA_RANK + ROPE_DIM
    latent_cache = torch.randn(num_blocks, block_size, latent_dim, device="cuda", dtype=dtype)
    query = torch.randn(len(seq_lens), NUM_HEADS, latent_dim, device="cuda", dtype=dtype)
    return latent_cache, meta, query


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_decode_matches_twin(triton_ops, block_size, dtype):
    seq_lens = [2048] * 60 + [1, 511, 513, 1500]  # batch 64 at 2k, plus partition edges
    latent_cache, meta, query = make_latent_batch(seq_lens, block_size, dtype)
    scale = (128 + ROPE_DIM) ** -0.5
    out = triton_ops.mla_paged_attention(query, latent_cache, meta, scale, KV_LORA_RANK)
    assert_close(out, torch_mla.mla_paged_attention(query, latent_cache, meta, scale, KV_LORA_RANK))


def test_mla_cache_write_matches_twin(triton_ops):
    latent_cache, meta, _ = make_latent_batch([2048] * 4, 64, torch.bfloat16)
    slots = torch.randperm(latent_cache.shape[0] * 64, device="cuda")[:300]
    slots[::7] = -1  # padding rows
    kv_c = torch.randn(300, KV_LORA_RANK, device="cuda", dtype=torch.bfloat16)
    k_pe = torch.randn(300, ROPE_DIM, device="cuda", dtype=torch.bfloat16)
    expected = latent_cache.clone()
    torch_mla.mla_cache_write(kv_c, k_pe, expected, slots)
    triton_ops.mla_cache_write(kv_c, k_pe, latent_cache, slots)
    assert torch.equal(latent_cache, expected)


@pytest.mark.parametrize(("q_lens", "k_lens"), [([2048, 2048], [2048, 2048]), ([512, 1, 100], [2048, 700, 100])])
def test_sdpa_varlen_matches_twin(triton_ops, q_lens, k_lens):
    """MLA prefill rows: per-head K [Tk, 16, 192] and V [Tk, 16, 128], cold prompts and cached prefixes."""
    torch.manual_seed(0)
    cu_q, cu_k = [0], [0]
    for q_len, k_len in zip(q_lens, k_lens, strict=True):
        cu_q.append(cu_q[-1] + q_len)
        cu_k.append(cu_k[-1] + k_len)
    query = torch.randn(cu_q[-1], NUM_HEADS, 192, device="cuda", dtype=torch.bfloat16)
    key = torch.randn(cu_k[-1], NUM_HEADS, 192, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(cu_k[-1], NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    out = triton_ops.varlen_causal_attention(query, key, value, cu_q, cu_k, 192**-0.5)
    assert_close(out, torch_mla.varlen_causal_attention(query, key, value, cu_q, cu_k, 192**-0.5))


def test_cuda_ops_carry_the_deepseek_kernels(triton_ops):
    cuda_ops = get_ops("cuda")
    assert cuda_ops.fused_moe is triton_ops.fused_moe
    assert cuda_ops.mla_paged_attention is triton_ops.mla_paged_attention
    assert cuda_ops.mla_cache_write is triton_ops.mla_cache_write
    assert cuda_ops.varlen_causal_attention is triton_ops.varlen_causal_attention
