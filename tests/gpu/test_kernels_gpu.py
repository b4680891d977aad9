"""Parity of the compiled Triton kernels with their torch twins on CUDA, at serving-sized shapes.

Self-contained: imports only torch, triton and deepinfer.kernels, so it runs on a bare GPU image
(`PYTHONPATH=shared python -m pytest tests/gpu -q --noconftest`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer.kernels import build_attention_metadata, get_ops, torch_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


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


def make_batch(q_lens, seq_lens, block_size, dtype, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
               head_dim=HEAD_DIM, num_pad_rows=0, seed=0):
    """Random cache (every slot filled), shuffled block tables, new K/V rows and queries on the GPU."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_tables, slot_mapping, used = [], [], 0
    for q_len, seq_len, n in zip(q_lens, seq_lens, blocks_per_seq, strict=True):
        table = perm[used : used + n]
        used += n
        block_tables.append(table)
        slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
    slot_mapping += [-1] * num_pad_rows
    meta = build_attention_metadata(q_lens, seq_lens, block_tables, slot_mapping, device="cuda")
    torch.manual_seed(seed)
    num_rows = sum(q_lens) + num_pad_rows
    return SimpleNamespace(
        meta=meta,
        kv_cache=torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype),
        query=torch.randn(num_rows, num_heads, head_dim, device="cuda", dtype=dtype),
        key=torch.randn(num_rows, num_kv_heads, head_dim, device="cuda", dtype=dtype),
        value=torch.randn(num_rows, num_kv_heads, head_dim, device="cuda", dtype=dtype),
    )


def test_decode_batch_64_at_2k_context(triton_ops):
    seq_lens = torch.randint(1536, 2561, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    b = make_batch([1] * 64, seq_lens, 16, torch.bfloat16)
    out = triton_ops.paged_attention(b.query, b.kv_cache, b.meta, HEAD_DIM**-0.5)
    assert_close(out, torch_ops.paged_attention(b.query, b.kv_cache, b.meta, HEAD_DIM**-0.5))


@pytest.mark.parametrize("sliding_window", [None, 4096])
def test_decode_split_k_at_32k_context(triton_ops, sliding_window):
    b = make_batch([1, 1, 1, 1], [32768, 20000, 513, 1], 32, torch.bfloat16)
    out = triton_ops.paged_attention(b.query, b.kv_cache, b.meta, 0.1, sliding_window)
    assert_close(out, torch_ops.paged_attention(b.query, b.kv_cache, b.meta, 0.1, sliding_window))


def test_prefill_4x4096(triton_ops):
    b = make_batch([4096] * 4, [4096] * 4, 16, torch.bfloat16)
    out = triton_ops.paged_attention(b.query, b.kv_cache, b.meta, HEAD_DIM**-0.5)
    assert_close(out, torch_ops.paged_attention(b.query, b.kv_cache, b.meta, HEAD_DIM**-0.5))


# decode rows, prefill over a cached prefix (chunked prefill), fresh prefills, and a q_len 1 "prefill" row
MIXED = ([1, 1000, 777, 1, 300, 1], [3000, 4000, 777, 1, 2048, 17])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(16, 8, 128), (32, 32, 64), (1, 8, 64)])
def test_cache_write_then_mixed_batch(triton_ops, dtype, block_size, num_kv_heads, head_dim):
    b = make_batch(*MIXED, block_size, dtype, num_kv_heads=num_kv_heads, head_dim=head_dim, num_pad_rows=5)
    expected_cache = b.kv_cache.clone()
    torch_ops.reshape_and_cache(b.key, b.value, expected_cache, b.meta.slot_mapping)
    triton_ops.reshape_and_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    assert torch.equal(b.kv_cache, expected_cache)
    for window in (None, 256):
        out = triton_ops.paged_attention(b.query, b.kv_cache, b.meta, head_dim**-0.5, window)
        assert_close(out, torch_ops.paged_attention(b.query, b.kv_cache, b.meta, head_dim**-0.5, window))


@pytest.mark.parametrize("q_lens", [[1] * 8, [1, 64, 1, 200, 1, 1, 37, 1]])
def test_attention_replays_in_a_cuda_graph(triton_ops, q_lens):
    # capture fails on any host sync, so this also proves the dispatch reads only host-side ints
    b = make_batch(q_lens, [900, 1200, 64, 2000, 1, 700, 37, 5000], 16, torch.bfloat16)

    def step():
        triton_ops.reshape_and_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
        return triton_ops.paged_attention(b.query, b.kv_cache, b.meta, HEAD_DIM**-0.5)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for tensor in (b.query, b.key, b.value):
        tensor.copy_(torch.randn_like(tensor))
    graph.replay()
    torch.cuda.synchronize()
    expected_cache = b.kv_cache.clone()
    torch_ops.reshape_and_cache(b.key, b.value, expected_cache, b.meta.slot_mapping)
    assert torch.equal(b.kv_cache, expected_cache)
    assert_close(out, torch_ops.paged_attention(b.query, b.kv_cache, b.meta, HEAD_DIM**-0.5))


@pytest.mark.parametrize(("q_lens", "one_kernel"), [
    ([1, 40, 1, 1, 200, 1], False),  # a mixed step: prompts through the prefill kernel, decode rows the decode one
    ([1, 40, 1, 1, 200, 1], True),   # the same in one kernel (num_decodes not counted)
    ([33, 300], False),              # prompts only
    ([1, 1, 1], False),              # single rows only (a 1-token prompt remainder beside decode rows)
])
def test_attention_plan_replays_match_each_layer(triton_ops, q_lens, one_kernel):
    """The plan's replayed launches give each layer's own attention: layers 1 and 3 replay layer 0's recording,
    layer 2 (another window) and layer 4 (another cache shape) record their own; padding rows come back zeros."""
    seq_lens = [q + 97 * i for i, q in enumerate(q_lens)]
    b = make_batch(q_lens, seq_lens, 16, torch.bfloat16, num_pad_rows=3)
    if one_kernel:
        b.meta.num_decodes = None
    caches = [torch.randn_like(b.kv_cache) for _ in range(4)]
    caches.append(torch.randn(2, b.kv_cache.shape[1] + 5, *b.kv_cache.shape[2:], device="cuda", dtype=torch.bfloat16))
    windows = [None, None, 64, None, None]
    out = torch.full_like(b.query, float("nan"))
    plan = triton_ops.AttentionPlan(b.query, out, b.meta)
    for i, (cache, window) in enumerate(zip(caches, windows, strict=True)):
        plan(cache, HEAD_DIM**-0.5, window)
        expected = torch_ops.paged_attention(b.query, cache, b.meta, HEAD_DIM**-0.5, window)
        assert_close(out, expected)
        assert torch.equal(out, triton_ops.paged_attention(b.query, cache, b.meta, HEAD_DIM**-0.5, window)), i
        assert plan.num_replays == (i >= 1) + (i >= 3), (i, plan.num_replays)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_rotary_and_activation_at_model_shapes(triton_ops, dtype):
    torch.manual_seed(2)
    num_tokens, hidden_size, inter_size = 4096, 4096, 14336
    x = torch.randn(num_tokens, hidden_size, device="cuda").to(dtype)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(hidden_size, device="cuda")).to(dtype)
    assert_close(triton_ops.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x, weight, 1e-6))
    normed, summed = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_summed = torch_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_close(normed, expected_normed)
    assert torch.equal(summed, expected_summed)

    gate_up = (torch.randn(num_tokens, 2 * inter_size, device="cuda") * 3).to(dtype)
    assert_close(triton_ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up))

    qkv = torch.randn(num_tokens, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
    query, key = qkv[:, :NUM_HEADS], qkv[:, NUM_HEADS : NUM_HEADS + NUM_KV_HEADS]
    positions = torch.randint(0, 32768, (num_tokens,), device="cuda")
    for rotary_dim, is_neox in ((128, True), (128, False), (64, True)):
        inv_freq = 1.0 / (500000 ** (torch.arange(0, rotary_dim, 2, device="cuda").float() / rotary_dim))
        freqs = torch.outer(torch.arange(32768, device="cuda").float(), inv_freq)
        cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        q_out, k_out = triton_ops.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
        q_ref, k_ref = torch_ops.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
        assert_close(q_out, q_ref)
        assert_close(k_out, k_ref)


def test_get_ops_cuda_picks_the_triton_kernels(triton_ops):
    ops = get_ops("cuda")
    assert all(getattr(ops, name) is fn for name, fn in triton_ops.overrides().items())
