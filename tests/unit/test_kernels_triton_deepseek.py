"""Parity of the DeepSeek Triton kernels (fused MoE, MLA decode) with their torch twins, in Triton's interpreter.

Same fixture approach as test_kernels_triton.py: the `ops` fixture imports fresh copies of triton and of our
kernel modules with TRITON_INTERPRET=1 and puts the previous modules back afterwards. Shapes stay small.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from deepinfer.kernels import build_attention_metadata, get_ops, sdpa_paged, torch_mla, torch_moe
from deepinfer.testing.triton_interpret import interpreted_kernels

KERNEL_MODULES = ("triton_moe", "triton_mla", "triton_ops")
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}  # (rtol, atol)


@pytest.fixture(scope="module")
def ops() -> Iterator[SimpleNamespace]:
    """Our Triton kernel modules in Triton's interpreter, as one namespace."""
    with interpreted_kernels(KERNEL_MODULES) as modules:
        yield modules


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Elementwise |a - e| <= atol + rtol * |e| at the dtype's tolerance; dtypes must agree."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol, atol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def make_moe(num_tokens, num_experts, top_k, hidden_size, inter_size, dtype, seed=0, idle_expert=None):
    """Random hidden states and experts; ragged routing (skewed to low ids), one expert left without tokens."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter_size, hidden_size, generator=g) * hidden_size**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden_size, inter_size, generator=g) * inter_size**-0.5).to(dtype)
    scores = torch.randn(num_tokens, num_experts, generator=g) - torch.arange(num_experts) * 0.3
    if idle_expert is not None:
        scores[:, idle_expert] = float("-inf")
    topk_weights, topk_ids = torch.softmax(scores, dim=-1).topk(top_k, dim=-1)
    return hidden, w13, w2, topk_weights.float(), topk_ids


MOE_CASES = [  # num_tokens, num_experts, top_k, hidden_size, inter_size, dtype, block_m
    (13, 8, 2, 64, 48, torch.float32, None),
    (13, 8, 2, 64, 48, torch.float32, 64),
    (40, 6, 3, 96, 40, torch.float32, 16),
    (1, 8, 2, 64, 48, torch.float32, None),
    (13, 8, 2, 64, 48, torch.bfloat16, None),
]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden_size", "inter_size", "dtype", "block_m"),
                         MOE_CASES)
def test_fused_moe_matches_twin(ops, num_tokens, num_experts, top_k, hidden_size, inter_size, dtype, block_m):
    hidden, w13, w2, topk_weights, topk_ids = make_moe(
        num_tokens, num_experts, top_k, hidden_size, inter_size, dtype, idle_expert=num_experts // 2
    )
    counts = torch.bincount(topk_ids.reshape(-1), minlength=num_experts)
    assert counts[num_experts // 2] == 0, "one expert gets no tokens"
    assert num_tokens == 1 or counts.max() > counts[counts > 0].min(), "ragged expert loads"
    out = ops.triton_moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids, block_m=block_m)
    expected = torch_moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    assert expected.abs().min() > 0
    assert_close(out, expected)


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_pairs_groups_each_expert_into_whole_blocks(ops, block_m):
    _, _, _, _, topk_ids = make_moe(37, 8, 3, 16, 16, torch.float32, seed=4, idle_expert=5)
    sorted_pair_ids, block_expert_ids = ops.triton_moe.align_pairs_to_blocks(topk_ids, 8, block_m)
    flat = topk_ids.reshape(-1)
    num_pairs = flat.shape[0]
    assert sorted_pair_ids.shape[0] == block_expert_ids.shape[0] * block_m
    valid = sorted_pair_ids < num_pairs
    assert sorted(sorted_pair_ids[valid].tolist()) == list(range(num_pairs)), "every pair exactly once"
    pair_experts = torch.full_like(sorted_pair_ids, -1)
    pair_experts[valid] = flat[sorted_pair_ids[valid].long()].int()
    for m, expert in enumerate(block_expert_ids.tolist()):
        block = pair_experts[m * block_m : (m + 1) * block_m]
        if expert == 8:
            assert (block == -1).all(), "unused blocks hold only padding"
        else:
            assert block[0] == expert and ((block == expert) | (block == -1)).all()
    assert 5 not in block_expert_ids.tolist()


def make_latent_batch(seq_lens, block_size, num_heads, kv_lora_rank, rope_dim, dtype, q_lens=None, seed=0):
    """Random latent cache with shuffled block tables and absorbed queries [T, H, kv_lora_rank + rope_dim]."""
    q_lens = q_lens or [1] * len(seq_lens)
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    latent_cache = torch.randn(num_blocks, block_size, kv_lora_rank + rope_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # block ids out of order, as after eviction
    block_tables, slot_mapping, used = [], [], 0
    for q_len, seq_len, n in zip(q_lens, seq_lens, blocks_per_seq, strict=True):
        table = perm[used : used + n]
        used += n
        block_tables.append(table)
        slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
    meta = build_attention_metadata(q_lens, seq_lens, block_tables, slot_mapping)
    query = torch.randn(sum(q_lens) + 2, num_heads, kv_lora_rank + rope_dim, generator=g).to(dtype)  # 2 pad rows
    return SimpleNamespace(latent_cache=latent_cache, meta=meta, query=query)


MLA_CASES = [  # block_size, num_heads, kv_lora_rank, rope_dim, dtype
    (16, 4, 64, 16, torch.float32),
    (64, 20, 32, 8, torch.float32),
    (16, 4, 48, 16, torch.bfloat16),
]


@pytest.mark.parametrize(("block_size", "num_heads", "kv_lora_rank", "rope_dim", "dtype"), MLA_CASES)
def test_mla_decode_matches_twin(ops, block_size, num_heads, kv_lora_rank, rope_dim, dtype):
    # contexts of 1..4 partitions of 32 keys, and a q_len 0 sequence (batch padding of a graph-sized batch)
    seq_lens, q_lens = [100, 1, 32, 5, 33], [1, 1, 1, 0, 1]
    b = make_latent_batch(seq_lens, block_size, num_heads, kv_lora_rank, rope_dim, dtype, q_lens=q_lens)
    scale = 0.7 * (kv_lora_rank + rope_dim) ** -0.5
    expected = torch_mla.mla_paged_attention(b.query, b.latent_cache, b.meta, scale, kv_lora_rank)
    split = ops.triton_mla.mla_decode_attention(b.query, b.latent_cache, b.meta, scale, kv_lora_rank,
                                                partition_size=32)
    assert_close(split, expected)
    assert not split[sum(q_lens) :].any(), "batch padding rows must come back as zeros"
    whole = ops.triton_ops.mla_paged_attention(b.query, b.latent_cache, b.meta, scale, kv_lora_rank)
    assert_close(whole, expected)  # the default partitioning (16-key partitions here)


@pytest.mark.parametrize(("max_seq_len", "num_programs", "expected"),
                         [(2048, 1, 128), (2048, 64, 512), (8192, 1, 512), (512, 1, 32), (100_000, 1, 8192)])
def test_mla_partitions_fill_the_gpu_within_the_reduce_kernels_limit(ops, max_seq_len, num_programs, expected):
    size = ops.triton_mla._partition_size(max_seq_len, num_programs, 32)
    assert size == expected and -(-max_seq_len // size) <= ops.triton_mla.MAX_PARTITIONS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_cache_write_matches_twin(ops, dtype):
    g = torch.Generator().manual_seed(3)
    kv_c, k_pe = torch.randn(7, 48, generator=g).to(dtype), torch.randn(7, 16, generator=g).to(dtype)
    slots = torch.tensor([5, 70, -1, 0, 33, -1, 127])  # two padding rows (slot -1) are skipped
    expected = torch.randn(8, 16, 64, generator=g).to(dtype)
    actual = expected.clone()
    torch_mla.mla_cache_write(kv_c, k_pe, expected, slots)
    ops.triton_mla.mla_cache_write(kv_c, k_pe, actual, slots)
    assert torch.equal(actual, expected)


def test_mla_paged_attention_hands_prefill_rows_to_the_twin(ops):
    b = make_latent_batch([20, 9], 16, 4, 32, 16, torch.float32, q_lens=[3, 9])
    out = ops.triton_ops.mla_paged_attention(b.query, b.latent_cache, b.meta, 0.2, 32)
    assert_close(out, torch_mla.mla_paged_attention(b.query, b.latent_cache, b.meta, 0.2, 32))


def test_cuda_ops_carry_the_deepseek_kernels(ops):
    cuda_ops, cpu_ops = get_ops("cuda"), get_ops("cpu")
    assert cuda_ops.fused_moe is ops.triton_ops.fused_moe is ops.triton_moe.fused_moe
    assert cuda_ops.mla_paged_attention is ops.triton_ops.mla_paged_attention
    assert cuda_ops.mla_cache_write is ops.triton_mla.mla_cache_write
    assert cpu_ops.mla_cache_write is torch_mla.mla_cache_write
    assert cpu_ops.fused_moe is torch_moe.fused_moe
    assert cpu_ops.mla_paged_attention is sdpa_paged.mla_paged_attention  # the CPU's SDPA twin of the reference


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "block_m"),
                         [(37, 8, 3, 16), (100, 6, 2, 32), (5, 64, 6, 16), (300, 20, 4, 64)])
def test_one_program_alignment_equals_the_sorting_one(ops, num_tokens, num_experts, top_k, block_m):
    """Same blocks, same pair order (a stable sort) across several 128-pair chunks; an idle expert."""
    _, _, _, _, topk_ids = make_moe(num_tokens, num_experts, top_k, 16, 16, torch.float32, seed=num_tokens,
                                    idle_expert=num_experts // 2)
    expected = ops.triton_moe.align_pairs_to_blocks(topk_ids, num_experts, block_m)
    actual = ops.triton_moe.align_pairs_one_program(topk_ids, num_experts, block_m)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


def test_single_token_blocks_hold_one_pair_each(ops):
    _, _, _, _, topk_ids = make_moe(1, 8, 3, 16, 16, torch.float32, seed=2)
    sorted_pair_ids, block_expert_ids = ops.triton_moe.pairs_in_own_blocks(topk_ids, 16)
    assert block_expert_ids.tolist() == topk_ids.reshape(-1).tolist()
    assert sorted_pair_ids.view(3, 16)[:, 0].tolist() == [0, 1, 2]
    assert (sorted_pair_ids.view(3, 16)[:, 1:] == 3).all(), "the other rows are padding (= num_pairs)"
