"""Torch kernel twins against straightforward float64 references on random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.kernels import KernelOps, build_attention_metadata, get_ops, resolve_accelerator, torch_ops


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


# --- paged attention -------------------------------------------------------------------------------


def _reference_attention(q, k, v, scale, sliding_window):
    """q [L, Hq, D] (the last L positions), k/v [S, Hkv, D]: per-head loops in float64."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    out = torch.empty(q_len, num_heads, q.shape[2], dtype=torch.float64)
    for h in range(num_heads):
        kv = h // (num_heads // num_kv_heads)
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            keys, values = k[lo : pos + 1, kv].double(), v[lo : pos + 1, kv].double()
            weights = torch.softmax(keys @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ values
    return out


def _paged_case(seq_lens, query_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed):
    """A cache holding each sequence's context in shuffled blocks, plus queries and the dense K/V."""
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    kv_cache = _randn(2, num_blocks, block_size, num_kv_heads, head_dim, seed=seed, dtype=dtype) * 5
    order = torch.randperm(num_blocks, generator=_gen(seed + 1)).tolist()
    block_tables, dense = [], []
    for b, seq_len in enumerate(seq_lens):
        table = [order.pop() for _ in range(blocks_per_seq[b])]
        k = _randn(seq_len, num_kv_heads, head_dim, seed=seed + 10 + b, dtype=dtype)
        v = _randn(seq_len, num_kv_heads, head_dim, seed=seed + 20 + b, dtype=dtype)
        for pos in range(seq_len):
            kv_cache[0, table[pos // block_size], pos % block_size] = k[pos]
            kv_cache[1, table[pos // block_size], pos % block_size] = v[pos]
        block_tables.append(table)
        dense.append((k, v))
    num_tokens = sum(query_lens)
    query = _randn(num_tokens + 2, num_heads, head_dim, seed=seed + 2, dtype=dtype)  # 2 padding rows
    meta = build_attention_metadata(query_lens, seq_lens, block_tables, [0] * (num_tokens + 2))
    return kv_cache, query, meta, dense


# Ragged mixes: (seq_lens, query_lens) — full prefill, prefill over a cached prefix, decode, empty rows.
BATCHES = [
    ([17], [17]),
    ([1], [1]),
    ([33, 5, 21], [33, 1, 6]),
    ([7, 40, 1, 19, 16], [1, 40, 1, 3, 0]),
    ([9, 30, 2, 17, 64], [1, 1, 1, 1, 1]),  # decode only: the batched single-token path
]


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: "x".join(map(str, b[0])))
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_paged_attention_matches_reference(block_size, gqa, batch, sliding_window):
    seq_lens, query_lens = batch
    num_kv_heads, head_dim = 2, 16
    kv_cache, query, meta, dense = _paged_case(
        seq_lens, query_lens, block_size, num_kv_heads * gqa, num_kv_heads, head_dim, torch.float32, seed=7
    )
    scale = head_dim**-0.5
    out = torch_ops.paged_attention(query, kv_cache, meta, scale, sliding_window)
    assert out.dtype == query.dtype and out.shape == query.shape
    starts = meta.query_start_loc_cpu
    for b, (k, v) in enumerate(dense):
        q = query[starts[b] : starts[b + 1]]
        ref = _reference_attention(q, k, v, scale, sliding_window)
        torch.testing.assert_close(out[starts[b] : starts[b + 1]].double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[starts[-1] :] == 0), "padding rows must come back as zeros"


def test_paged_attention_bfloat16_accumulates_in_float32():
    seq_lens, query_lens = [29, 12], [29, 1]
    kv_cache, query, meta, dense = _paged_case(seq_lens, query_lens, 16, 8, 2, 32, torch.bfloat16, seed=3)
    out = torch_ops.paged_attention(query, kv_cache, meta, 32**-0.5)
    assert out.dtype == torch.bfloat16
    for b, (k, v) in enumerate(dense):
        s, e = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
        ref = _reference_attention(query[s:e], k, v, 32**-0.5, None)
        torch.testing.assert_close(out[s:e].double(), ref, atol=2e-2, rtol=2e-2)


def test_paged_attention_rejects_bad_shapes():
    kv_cache, query, meta, _ = _paged_case([5], [5], 4, 6, 4, 16, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="multiple"):
        torch_ops.paged_attention(query, kv_cache, meta, 0.25)


# --- KV write ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_only_its_slots(block_size, dtype):
    num_blocks, num_kv_heads, head_dim, num_tokens = 13, 2, 8, 11
    kv_cache = _randn(2, num_blocks, block_size, num_kv_heads, head_dim, seed=0, dtype=dtype)
    before = kv_cache.clone()
    key = _randn(num_tokens, num_kv_heads, head_dim, seed=1, dtype=dtype)
    value = _randn(num_tokens, num_kv_heads, head_dim, seed=2, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=_gen(3))[:num_tokens]
    slots[[2, 5, 10]] = -1  # padding tokens
    torch_ops.reshape_and_cache(key, value, kv_cache, slots)
    expected = before.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = key[i]
            expected[1, slot // block_size, slot % block_size] = value[i]
    assert torch.equal(kv_cache, expected)


def test_reshape_and_cache_rejects_dtype_mismatch():
    kv_cache = _randn(2, 2, 4, 2, 8, seed=0)
    key = _randn(3, 2, 8, seed=1, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="dtypes"):
        torch_ops.reshape_and_cache(key, key, kv_cache, torch.tensor([0, 1, 2]))


# --- norms, RoPE, activation -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 8), (13, 64), (5, 100)])
def test_rms_norm_and_fused_add(shape):
    x, residual = _randn(*shape, seed=1), _randn(*shape, seed=2)
    weight = _randn(shape[1], seed=3)
    eps = 1e-5

    def reference(t):
        t = t.double()
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * weight.double()

    torch.testing.assert_close(torch_ops.rms_norm(x, weight, eps).double(), reference(x), atol=1e-5, rtol=1e-5)
    normed, summed = torch_ops.fused_add_rms_norm(x, residual, weight, eps)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(normed.double(), reference(x + residual), atol=1e-5, rtol=1e-5)


def _reference_rope(positions, x, inv_freq, is_neox):
    """Rotate feature pairs by position * inv_freq, in float64; features past rotary_dim pass through."""
    out = x.double().clone()
    half = inv_freq.shape[0]
    for t, pos in enumerate(positions.tolist()):
        for i in range(half):
            angle = pos * inv_freq[i].item()
            a, b = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
            x1, x2 = x[t, :, a].double(), x[t, :, b].double()
            out[t, :, a] = x1 * math.cos(angle) - x2 * math.sin(angle)
            out[t, :, b] = x2 * math.cos(angle) + x1 * math.sin(angle)
    return out


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 16), (32, 16), (64, 64)])
def test_rotary_embedding(is_neox, head_dim, rotary_dim):
    max_position, num_tokens = 300, 9
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim))
    freqs = torch.outer(torch.arange(max_position).double(), inv_freq)
    cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
    positions = torch.randint(0, max_position, (num_tokens,), generator=_gen(0))
    query, key = _randn(num_tokens, 4, head_dim, seed=1), _randn(num_tokens, 2, head_dim, seed=2)
    q_out, k_out = torch_ops.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    torch.testing.assert_close(q_out.double(), _reference_rope(positions, query, inv_freq, is_neox), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.double(), _reference_rope(positions, key, inv_freq, is_neox), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 2), (7, 64), (3, 344)])
def test_silu_and_mul(shape):
    x = _randn(*shape, seed=4)
    gate, up = x[:, : shape[1] // 2].double(), x[:, shape[1] // 2 :].double()
    ref = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(torch_ops.silu_and_mul(x).double(), ref, atol=1e-6, rtol=1e-6)


def test_gelu_tanh_and_mul_is_transformers_gelu_pytorch_tanh():
    from transformers.activations import ACT2FN

    x = torch.randn(7, 2 * 48, dtype=torch.float64) * 3
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(torch_ops.gelu_tanh_and_mul(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)


# --- selection ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("accelerator", ["cpu", "cuda", "ascend"])
def test_get_ops_falls_back_to_twins(accelerator):
    ops = get_ops(accelerator)
    assert isinstance(ops, KernelOps) and ops.accelerator == accelerator
    if accelerator == "cpu":  # the twins but for attention, KV write, RoPE, RMSNorm, linear (test_kernels_cpu.py)
        assert ops.silu_and_mul is torch_ops.silu_and_mul and ops.gelu_tanh_and_mul is torch_ops.gelu_tanh_and_mul
    assert set(ops.implementations()) == {
        "reshape_and_cache", "paged_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
        "gelu_tanh_and_mul", "fused_moe", "attention_plan", "mla_paged_attention", "mla_cache_write", "varlen_causal_attention",
        "gather_blocks", "scatter_blocks", "linear",
    }


def test_get_ops_and_resolve_reject_unknown_accelerators():
    with pytest.raises(ValueError, match="tpu"):
        get_ops("tpu")
    with pytest.raises(ValueError, match="tpu"):
        resolve_accelerator("tpu")
    assert resolve_accelerator("auto", torch.device("cpu")) == "cpu"
    assert resolve_accelerator("auto", "cuda:1") == "cuda"
    assert resolve_accelerator("cuda", torch.device("cpu")) == "cuda"


def test_ascend_names_the_triton_kernel_source_and_auto_picks_npu():
    from deepinfer.kernels import _ACCELERATED_MODULES

    # CANN images run the same Triton source through triton-ascend (untested hardware, see the module doc).
    assert _ACCELERATED_MODULES["ascend"] == _ACCELERATED_MODULES["cuda"] == "deepinfer.kernels.triton_ops"
    assert resolve_accelerator("auto", "npu:0") == "ascend"
    assert resolve_accelerator("ascend") == "ascend"
