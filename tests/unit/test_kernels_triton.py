"""Parity of the Triton kernels with their torch twins, run on the CPU by Triton's interpreter.

TRITON_INTERPRET is read when triton.language and each kernel are decorated, and other test modules (through
transformers) may have imported triton already; so the `ops` fixture imports fresh copies of triton and of
our kernel modules in interpreter mode and puts the previous modules back afterwards. Shapes stay small:
the interpreter runs every program in numpy.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from deepinfer.kernels import build_attention_metadata, get_ops, torch_ops
from deepinfer.testing.triton_interpret import interpreted_kernels

KERNEL_MODULES = ("triton_activation", "triton_attention", "triton_cache", "triton_norm", "triton_rotary", "triton_ops")
TOLERANCES = {  # (rtol, atol): fp32 to 1e-5; half types to about one unit in the last place
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1e-2),
}


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


def make_batch(q_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, num_pad_rows=0, seed=0):
    """Random cache, scattered block tables, new K/V rows and queries for a ragged batch (pad rows: slot -1)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # block ids out of order, as after eviction
    block_tables, slot_mapping, used = [], [], 0
    for q_len, seq_len, n in zip(q_lens, seq_lens, blocks_per_seq, strict=True):
        table = perm[used : used + n]
        used += n
        block_tables.append(table)
        for pos in range(seq_len - q_len, seq_len):
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
    slot_mapping += [-1] * num_pad_rows
    meta = build_attention_metadata(q_lens, seq_lens, block_tables, slot_mapping)
    num_rows = sum(q_lens) + num_pad_rows
    query = torch.randn(num_rows, num_heads, head_dim, generator=g).to(dtype)
    key = torch.randn(num_rows, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_rows, num_kv_heads, head_dim, generator=g).to(dtype)
    return SimpleNamespace(kv_cache=kv_cache, meta=meta, query=query, key=key, value=value)


# ragged: decode rows (q_len 1), fresh prefills (q_len == seq_len) and prefills over a cached prefix
MIXED = ([1, 7, 1, 20, 33], [70, 7, 9, 45, 33])
ATTENTION_CASES = [  # block_size, num_heads, num_kv_heads, head_dim, dtype
    (16, 4, 4, 64, torch.float32),
    (32, 8, 2, 128, torch.float32),
    (1, 4, 1, 64, torch.float32),
    (16, 8, 2, 64, torch.bfloat16),
    (32, 4, 4, 128, torch.bfloat16),
    (16, 4, 1, 64, torch.float16),
]


@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype"), ATTENTION_CASES)
def test_cache_write_then_mixed_attention_matches_twin(ops, block_size, num_heads, num_kv_heads, head_dim, dtype):
    b = make_batch(*MIXED, block_size, num_heads, num_kv_heads, head_dim, dtype, num_pad_rows=3)
    expected_cache = b.kv_cache.clone()
    torch_ops.reshape_and_cache(b.key, b.value, expected_cache, b.meta.slot_mapping)
    ops.triton_ops.reshape_and_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    assert torch.equal(b.kv_cache, expected_cache)

    scale = head_dim**-0.5
    out = ops.triton_ops.paged_attention(b.query, b.kv_cache, b.meta, scale)
    assert_close(out, torch_ops.paged_attention(b.query, b.kv_cache, b.meta, scale))
    assert not out[sum(MIXED[0]) :].any(), "batch padding rows must come back as zeros"


@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype"), ATTENTION_CASES)
def test_decode_split_k_matches_twin(ops, block_size, num_heads, num_kv_heads, head_dim, dtype):
    # contexts of 1..4 partitions of 64 keys, plus a q_len 0 sequence (batch padding of a graph-sized batch)
    b = make_batch([1, 1, 1, 0, 1], [200, 1, 64, 5, 129], block_size, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    expected = torch_ops.paged_attention(b.query, b.kv_cache, b.meta, scale)
    split = ops.triton_attention.paged_decode_attention(b.query, b.kv_cache, b.meta, scale, partition_size=64)
    assert_close(split, expected)
    assert_close(ops.triton_ops.paged_attention(b.query, b.kv_cache, b.meta, scale), expected)  # one partition


@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype"), ATTENTION_CASES[:4])
def test_mixed_step_splits_decode_rows_to_the_decode_kernel(
    ops, monkeypatch, block_size, num_heads, num_kv_heads, head_dim, dtype
):
    """A mixed step's single-row sequences go to the split-K decode kernel, its prompts to the prefill kernel,
    into one output; each kernel alone leaves the other's rows unwritten."""
    # decode rows over 1..3 partitions of 64 keys, a prompt's last token over a cached prefix (q_len 1, 70),
    # fresh and prefixed prompts
    q_lens, seq_lens = [1, 9, 1, 20, 1, 1], [150, 9, 64, 45, 70, 1]
    b = make_batch(q_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, num_pad_rows=2)
    scale = head_dim**-0.5
    expected = torch_ops.paged_attention(b.query, b.kv_cache, b.meta, scale)
    attention = ops.triton_attention
    prompts = attention.prefill_attention(b.query, b.kv_cache, b.meta, scale, min_query_len=2)
    unwritten = prompts.clone()
    both = attention.paged_decode_attention(b.query, b.kv_cache, b.meta, scale, partition_size=64, out=prompts)
    assert both is prompts
    assert_close(both, expected)
    decode_rows = [b.meta.query_start_loc_cpu[i] for i, q_len in enumerate(q_lens) if q_len == 1]
    prompt_rows = [r for r in range(sum(q_lens)) if r not in decode_rows]
    assert torch.equal(both[prompt_rows], unwritten[prompt_rows]), "the decode kernel wrote a prompt row"

    calls = []
    decode = ops.triton_ops.paged_decode_attention
    monkeypatch.setattr(ops.triton_ops, "paged_decode_attention", lambda *a, **k: calls.append(k) or decode(*a, **k))
    assert b.meta.num_decodes == 4
    assert_close(ops.triton_ops.paged_attention(b.query, b.kv_cache, b.meta, scale), expected)
    assert len(calls) == 1 and calls[0]["out"] is not None
    b.meta.num_decodes = None  # not counted: one prefill kernel for every row, as before
    assert_close(ops.triton_ops.paged_attention(b.query, b.kv_cache, b.meta, scale), expected)
    assert len(calls) == 1


def test_attention_plan_matches_twin_layer_by_layer(ops):
    """The Triton plan and its torch twin write each layer's attention into the step's buffer (pad rows zeros);
    under the interpreter nothing is recorded, so every layer takes the plain path (replays: tests/gpu)."""
    b = make_batch(*MIXED, 16, 4, 2, 64, torch.float32, num_pad_rows=2)
    caches = [b.kv_cache, torch.randn_like(b.kv_cache)]
    out, twin_out = torch.full_like(b.query, float("nan")), torch.full_like(b.query, float("nan"))
    plan = ops.triton_ops.AttentionPlan(b.query, out, b.meta)
    twin = torch_ops.AttentionPlan(b.query, twin_out, b.meta)
    for cache, window in zip(caches, (None, 8), strict=True):
        plan(cache, 0.125, window)
        twin(cache, 0.125, window)
        assert_close(twin_out, torch_ops.paged_attention(b.query, cache, b.meta, 0.125, window))
        assert_close(out, twin_out)
    assert plan.num_replays == 0


@pytest.mark.parametrize("decode", [True, False])
def test_sliding_window_matches_twin(ops, decode):
    q_lens = [1, 1, 1] if decode else [1, 30, 12]
    b = make_batch(q_lens, [100, 30, 40], 16, 8, 2, 64, torch.float32)
    expected = torch_ops.paged_attention(b.query, b.kv_cache, b.meta, 0.1, sliding_window=24)
    if decode:
        out = ops.triton_attention.paged_decode_attention(
            b.query, b.kv_cache, b.meta, 0.1, sliding_window=24, partition_size=64
        )
    else:
        out = ops.triton_ops.paged_attention(b.query, b.kv_cache, b.meta, 0.1, sliding_window=24)
    assert_close(out, expected)
    assert not torch.allclose(out, torch_ops.paged_attention(b.query, b.kv_cache, b.meta, 0.1), atol=1e-3)


@pytest.mark.parametrize("q_lens", [[1, 1], [1, 9]])
def test_attention_reads_a_strided_query_view(ops, q_lens):
    b = make_batch(q_lens, [20, 9], 16, 4, 2, 64, torch.float32)
    qkv = torch.randn(b.query.shape[0], 8, 64)  # q heads 0..3 of a fused [T, Hq + 2 * Hkv, D] projection
    query = qkv[:, :4]
    assert not query.is_contiguous()
    out = ops.triton_ops.paged_attention(query, b.kv_cache, b.meta, 0.125)
    assert_close(out, torch_ops.paged_attention(query.contiguous(), b.kv_cache, b.meta, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [64, 200])
def test_rms_norms_match_twin(ops, dtype, hidden_size):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, hidden_size, generator=g) * 3).to(dtype)
    residual = torch.randn(7, hidden_size, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden_size, generator=g)).to(dtype)
    assert_close(ops.triton_ops.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x, weight, 1e-6))
    normed, summed = ops.triton_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_summed = torch_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_close(normed, expected_normed)
    assert torch.equal(summed, expected_summed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_embedding_matches_twin(ops, dtype, is_neox, rotary_dim):
    g = torch.Generator().manual_seed(2)
    num_tokens, head_dim = 6, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(512).float(), inv_freq)
    cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, rotary_dim]
    positions = torch.randint(0, 512, (num_tokens,), generator=g)
    qkv = torch.randn(num_tokens, 4 + 2 + 2, head_dim, generator=g).to(dtype)
    query, key = qkv[:, :4], qkv[:, 4:6]  # strided views of a fused projection, GQA 4:2
    q_out, k_out = ops.triton_ops.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    q_ref, k_ref = torch_ops.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    assert_close(q_out, q_ref)
    assert_close(k_out, k_ref)
    assert torch.equal(q_out[..., rotary_dim:], query[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter_size", [48, 1100])
def test_silu_and_mul_matches_twin(ops, dtype, inter_size):
    x = (torch.randn(5, 2 * inter_size, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    assert_close(ops.triton_ops.silu_and_mul(x), torch_ops.silu_and_mul(x))


def test_cuda_ops_are_the_triton_kernels(ops):
    cuda_ops = get_ops("cuda")
    for name, fn in ops.triton_ops.overrides().items():
        assert getattr(cuda_ops, name) is fn, name
    # The CPU keeps the twins where it has no op of its own (it has its SDPA attention, RMSNorm and RoPE)
    assert get_ops("cpu").silu_and_mul is torch_ops.silu_and_mul
