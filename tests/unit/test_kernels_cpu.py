"""The CPU's ops (kernels.cpu_ops, kernels.sdpa_paged, kernels.blocked_attention, kernels.cpu_linear) against the
torch twins on random inputs: attention over cold prompts, prefix hits, chunked prefill, ragged decode batches, empty
and padding rows, GQA, sliding windows, MLA, the step's gather plan shared by the layers, bfloat16's blocked prefill;
the KV write, RoPE and the float32 linear through oneDNN."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepinfer.kernels import (
    blocked_attention,
    build_attention_metadata,
    cpu_linear,
    cpu_ops,
    get_ops,
    sdpa_paged,
    torch_mla,
    torch_ops,
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _case(seq_lens, query_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed, width=None):
    """A random cache (never zeros) whose sequences own shuffled blocks, queries with 2 padding rows, metadata.
    width: the cache's last dim when it differs from the query's (MLA's latent rows: width = head_dim)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = [[order.pop() for _ in range(n)] for n in blocks_per_seq]
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim) if width is None else (num_blocks, block_size, width)
    cache = (torch.randn(*shape, generator=g) * 2).to(dtype)
    query = torch.randn(sum(query_lens) + 2, num_heads, head_dim, generator=g).to(dtype)
    meta = build_attention_metadata(query_lens, seq_lens, tables, [0] * (sum(query_lens) + 2))
    return cache, query, meta


# (seq_lens, query_lens): cold prompts, prefix hits, chunks of a long prompt, ragged decodes, empty rows, mixes.
BATCHES = [
    ([17], [17]),
    ([1], [1]),
    ([40], [1]),  # a lone decode: the per-sequence path
    ([300], [128]),  # a chunk over a 172-token prefix
    ([33, 5, 21], [33, 1, 6]),
    ([7, 40, 1, 19, 16], [1, 40, 1, 3, 0]),
    ([9, 30, 2, 17, 64], [1, 1, 1, 1, 1]),  # decode only, ragged: the batched padded path
    ([64, 64, 64], [1, 1, 1]),  # decode only, equal lengths
    ([130, 77, 5], [2, 77, 5]),  # a two-row tail over a prefix beside cold prompts
]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (9, 3)])
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: "x".join(map(str, b[0])) + "q" + "x".join(map(str, b[1])))
@pytest.mark.parametrize("sliding_window", [None, 6, 50])
def test_paged_attention_matches_the_twin(block_size, num_heads, num_kv_heads, batch, sliding_window):
    seq_lens, query_lens = batch
    cache, query, meta = _case(seq_lens, query_lens, block_size, num_heads, num_kv_heads, 16, torch.float32, seed=3)
    out = sdpa_paged.paged_attention(query, cache, meta, 0.3, sliding_window)
    expected = torch_ops.paged_attention(query, cache, meta, 0.3, sliding_window)
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert not out[meta.query_start_loc_cpu[-1]:].any(), "padding rows must come back as zeros"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_long_chunk_over_a_long_prefix(head_dim):
    """The shapes of a real chunked prefill: a 256-row chunk over 700 cached tokens, with a decode beside it."""
    cache, query, meta = _case([956, 300], [256, 1], 16, 8, 2, head_dim, torch.float32, seed=4)
    torch.testing.assert_close(sdpa_paged.paged_attention(query, cache, meta, head_dim**-0.5),
                               torch_ops.paged_attention(query, cache, meta, head_dim**-0.5), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("batch", [
    ([29, 12, 80, 40], [29, 1, 30, 1]),  # a cold prompt, a chunk over a prefix, decodes beside them
    ([9, 30, 2, 17, 64], [1, 1, 1, 1, 1]),  # decode only, ragged: the padded batch with its key mask
    ([40], [1]),  # a lone decode
], ids=["mixed", "decodes", "one-decode"])
@pytest.mark.parametrize("sliding_window", [None, 8])
def test_paged_attention_bfloat16_stays_close_to_the_twin(batch, sliding_window):
    """The dtype `auto` gives on a CPU with bf16 instructions: the kernel's float32 accumulation against the twin's
    float32 scores, within bfloat16's rounding of the output."""
    cache, query, meta = _case(*batch, 16, 9, 3, 64, torch.bfloat16, seed=5)
    out = sdpa_paged.paged_attention(query, cache, meta, 64**-0.5, sliding_window)
    assert out.dtype == torch.bfloat16
    expected = torch_ops.paged_attention(query, cache, meta, 64**-0.5, sliding_window)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_one_gather_plan_serves_every_layer_of_the_step():
    """The decode rows' gather indices are built by the first call and reused for the other layers' caches; a
    different window, other tables (replaced metadata sharing the dict, or static tables rewritten) its own."""
    cache, query, meta = _case([9, 30, 2, 17], [1, 1, 1, 1], 4, 6, 2, 16, torch.float32, seed=9)
    query = query[:4]  # decodes only: the output is the attention itself
    other_layer = torch.randn(cache.shape, generator=torch.Generator().manual_seed(10))
    for layer_cache, window in ((cache, None), (other_layer, None), (other_layer, 5), (cache, 5)):
        torch.testing.assert_close(sdpa_paged.paged_attention(query, layer_cache, meta, 0.3, window),
                                   torch_ops.paged_attention(query, layer_cache, meta, 0.3, window), atol=2e-5,
                                   rtol=2e-5)
    assert len(meta.layer_shared) == 2  # one plan per window
    shuffled = build_attention_metadata([1] * 4, meta.seq_lens_cpu, meta.block_tables.flip(0).tolist(), [0] * 4)
    shuffled.layer_shared = meta.layer_shared  # as dataclasses.replace would share it
    torch.testing.assert_close(sdpa_paged.paged_attention(query, cache, shuffled, 0.3),
                               torch_ops.paged_attention(query, cache, shuffled, 0.3), atol=2e-5, rtol=2e-5)
    meta.block_tables.copy_(meta.block_tables.roll(1, 0))  # a graph runner's static tables, rewritten in place
    torch.testing.assert_close(sdpa_paged.paged_attention(query, cache, meta, 0.3),
                               torch_ops.paged_attention(query, cache, meta, 0.3), atol=2e-5, rtol=2e-5)


def test_attention_plan_writes_the_fast_attention_into_out():
    cache, query, meta = _case([33, 5], [33, 1], 4, 4, 2, 16, torch.float32, seed=6)
    out = torch.full_like(query, 7.0)
    sdpa_paged.AttentionPlan(query, out, meta)(cache, 0.25, 10)
    assert torch.equal(out, sdpa_paged.paged_attention(query, cache, meta, 0.25, 10))


@pytest.mark.parametrize("batch", [([9], [9]), ([30, 7, 12], [6, 1, 12]), ([21, 8, 15], [1, 1, 1])])
def test_mla_paged_attention_matches_the_twin(batch):
    seq_lens, query_lens = batch
    kv_lora_rank, latent = 24, 32
    cache, query, meta = _case(seq_lens, query_lens, 4, 4, 1, latent, torch.float32, seed=8, width=latent)
    out = sdpa_paged.mla_paged_attention(query, cache, meta, 0.2, kv_lora_rank)
    torch.testing.assert_close(out, torch_mla.mla_paged_attention(query, cache, meta, 0.2, kv_lora_rank),
                               atol=2e-5, rtol=2e-5)
    assert out.shape == (query.shape[0], 4, kv_lora_rank) and not out[meta.query_start_loc_cpu[-1]:].any()


def test_mla_paged_attention_bfloat16_stays_close_to_the_twin():
    cache, query, meta = _case([30, 7, 12], [6, 1, 12], 4, 4, 1, 32, torch.bfloat16, seed=8, width=32)
    out = sdpa_paged.mla_paged_attention(query, cache, meta, 0.2, 24)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch_mla.mla_paged_attention(query, cache, meta, 0.2, 24).float(),
                               atol=2e-2, rtol=2e-2)


@pytest.fixture
def blocked_everywhere(monkeypatch):
    """Every prompt row through blocked_attention, in any dtype over any number of keys, 12 query rows a block: the
    batches above then hold its loop (several blocks, a ragged last one, one short block) to the twin in float32."""
    monkeypatch.setattr(blocked_attention, "wins", lambda dtype, num_keys_seen: True)
    monkeypatch.setattr(blocked_attention, "BLOCK_Q", 12)


@pytest.mark.usefixtures("blocked_everywhere")
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (9, 3)])
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: "x".join(map(str, b[0])) + "q" + "x".join(map(str, b[1])))
@pytest.mark.parametrize("sliding_window", [None, 6, 50])
def test_blocked_attention_matches_the_twin(num_heads, num_kv_heads, batch, sliding_window):
    cache, query, meta = _case(*batch, 16, num_heads, num_kv_heads, 16, torch.float32, seed=3)
    out = sdpa_paged.paged_attention(query, cache, meta, 0.3, sliding_window)
    torch.testing.assert_close(out, torch_ops.paged_attention(query, cache, meta, 0.3, sliding_window), atol=2e-5,
                               rtol=2e-5)
    assert not out[meta.query_start_loc_cpu[-1]:].any(), "padding rows must come back as zeros"


@pytest.mark.usefixtures("blocked_everywhere")
def test_blocked_attention_serves_mla_rows():
    """MLA's one latent head (K = V = the latent row, wider than the output) through the blocked loop."""
    cache, query, meta = _case([30, 7, 40], [30, 1, 25], 4, 4, 1, 32, torch.float32, seed=8, width=32)
    torch.testing.assert_close(sdpa_paged.mla_paged_attention(query, cache, meta, 0.2, 24),
                               torch_mla.mla_paged_attention(query, cache, meta, 0.2, 24), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("sliding_window", [None, 300])
@pytest.mark.parametrize("batch", [([700], [700]), ([1000, 40, 300], [300, 1, 300])], ids=["cold", "chunk-decode-cold"])
def test_long_bfloat16_prompt_rows_go_blocked_close_to_the_twin(batch, sliding_window, monkeypatch):
    """What `auto` runs on a CPU with bf16 instructions: prompt rows over >= 256 keys take the blocked path (its
    default block, a ragged last one), a cold prompt, a chunk over a 700-token prefix and a decode beside them.
    Looser than the fused kernel's 2e-2 at the worst element: the scores are rounded to bfloat16 between the two
    matmuls (as transformers' eager bf16 attention rounds them), a score s off by up to |s| * 2**-9 (here |s| <= ~8:
    up to 1.6% on a weight); on average the error stays within bfloat16's rounding of the output."""
    calls = []
    blocked = blocked_attention.blocked_causal_attention
    monkeypatch.setattr(blocked_attention, "blocked_causal_attention", lambda *a: calls.append(1) or blocked(*a))
    cache, query, meta = _case(*batch, 16, 9, 3, 64, torch.bfloat16, seed=14)
    out = sdpa_paged.paged_attention(query, cache, meta, 64**-0.5, sliding_window)
    assert out.dtype == torch.bfloat16 and len(calls) == sum(n > 1 for n in batch[1])
    expected = torch_ops.paged_attention(query, cache, meta, 64**-0.5, sliding_window).float()
    torch.testing.assert_close(out.float(), expected, atol=8e-2, rtol=2e-2)
    assert (out.float() - expected).abs().mean() < 4e-3  # measured 2.5-2.7e-3, outputs ~0.4 on average
    assert not out[meta.query_start_loc_cpu[-1]:].any()


def test_blocked_attention_only_where_it_wins():
    """bfloat16 over >= MIN_KEYS keys (a window's width where shorter); never float32, whose matmuls gain nothing."""
    assert blocked_attention.wins(torch.bfloat16, blocked_attention.MIN_KEYS)
    assert not blocked_attention.wins(torch.bfloat16, blocked_attention.MIN_KEYS - 1)
    assert not blocked_attention.wins(torch.float32, 100_000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_causal_attention_matches_the_twin(dtype):
    """MLA's prefill rows on the CPU (sdpa_varlen): cold prompts (is_causal), prompts over a prefix (a bottom-right
    mask), an empty sequence, V narrower than Q/K (padded for the kernel), and 3 padding query rows."""
    g = torch.Generator().manual_seed(13)
    q_lens, k_lens = [7, 3, 0, 12], [7, 20, 5, 30]
    cu_q, cu_k = [0], [0]
    for q_len, k_len in zip(q_lens, k_lens, strict=True):
        cu_q.append(cu_q[-1] + q_len)
        cu_k.append(cu_k[-1] + k_len)
    query = torch.randn(cu_q[-1] + 3, 4, 24, generator=g).to(dtype)
    key = torch.randn(cu_k[-1], 4, 24, generator=g).to(dtype)
    value = torch.randn(cu_k[-1], 4, 16, generator=g).to(dtype)
    out = cpu_ops.varlen_causal_attention(query, key, value, cu_q, cu_k, 0.2)
    expected = torch_mla.varlen_causal_attention(query, key, value, cu_q, cu_k, 0.2)
    assert out.dtype == dtype and out.shape == (query.shape[0], 4, 16) and not out[cu_q[-1]:].any()
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_matches_the_twin(padding, dtype):
    g = torch.Generator().manual_seed(11)
    cache = torch.randn(2, 9, 4, 2, 8, generator=g).to(dtype)
    key, value = torch.randn(7, 2, 8, generator=g).to(dtype), torch.randn(7, 2, 8, generator=g).to(dtype)
    slots = torch.randperm(36, generator=g)[:7]
    if padding:
        slots[[1, 5]] = -1
    expected = cache.clone()
    torch_ops.reshape_and_cache(key, value, expected, slots)
    cpu_ops.reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 16), (32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_equals_the_twin(is_neox, head_dim, rotary_dim, dtype):
    """Bit for bit: the same products and sums, each rounded in the query's dtype as the twin's."""
    g = torch.Generator().manual_seed(12)
    cos_sin_cache = torch.randn(300, rotary_dim, generator=g)
    positions = torch.randint(0, 300, (9,), generator=g)
    qkv = torch.randn(9, 8 * head_dim, generator=g).to(dtype)
    # q and k as the fused QKV projection's split leaves them (k's heads right after q's: rotated in one pass), and
    # as separate tensors
    query, key = qkv[:, : 4 * head_dim].view(9, 4, head_dim), qkv[:, 4 * head_dim : 6 * head_dim].view(9, 2, head_dim)
    assert cpu_ops._side_by_side(query, key) is not None
    apart = (query.clone(), key.clone())
    assert cpu_ops._side_by_side(*apart) is None
    assert cpu_ops._side_by_side(query, qkv[:, 6 * head_dim :].view(9, 2, head_dim)) is None  # not right after q
    for q, k in ((query, key), apart):
        for got, want in zip(cpu_ops.rotary_embedding(positions, q, k, cos_sin_cache, is_neox),
                             torch_ops.rotary_embedding(positions, q, k, cos_sin_cache, is_neox), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_get_ops_cpu_takes_the_cpu_ops():
    ops = get_ops("cpu")
    assert ops.paged_attention is sdpa_paged.paged_attention
    assert ops.attention_plan is sdpa_paged.AttentionPlan
    assert ops.mla_paged_attention is sdpa_paged.mla_paged_attention
    assert ops.varlen_causal_attention is cpu_ops.varlen_causal_attention
    assert ops.reshape_and_cache is cpu_ops.reshape_and_cache and ops.rotary_embedding is cpu_ops.rotary_embedding
    assert ops.linear is cpu_linear.linear
    assert ops.rms_norm is cpu_ops.rms_norm and ops.fused_add_rms_norm is cpu_ops.fused_add_rms_norm
    assert ops.silu_and_mul is torch_ops.silu_and_mul  # the rest stay the twins


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_twin(rows, dtype):
    """Bit for bit, with and without the residual (float32: torch's F.rms_norm; bfloat16: the twin itself)."""
    g = torch.Generator().manual_seed(16)
    x, residual = (torch.randn(2, rows, 96, generator=g) * 3).to(dtype)
    weight = torch.randn(96, generator=g).to(dtype)
    got, want = cpu_ops.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x, weight, 1e-6)
    assert got.dtype == want.dtype and torch.equal(got, want)
    for g_out, w_out in zip(cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-6),
                            torch_ops.fused_add_rms_norm(x, residual, weight, 1e-6), strict=True):
        assert g_out.dtype == w_out.dtype and torch.equal(g_out, w_out)


@pytest.mark.parametrize("rows", [0, 1, 3, 8, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_the_twin(rows, bias, dtype):
    """Decode-sized and prompt-sized rows, with and without a bias, the input a strided view (the MLP's gate half)."""
    g = torch.Generator().manual_seed(13)
    weight = (torch.randn(96, 160, generator=g) / 160**0.5).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 320, generator=g).to(dtype)[:, :160]
    got, want = cpu_linear.linear(x, weight, b), torch_ops.linear(x, weight, b)
    assert got.dtype == want.dtype and got.shape == (rows, 96)
    if dtype == torch.bfloat16:  # F.linear itself: only float32 goes through oneDNN
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    x3 = x[: min(rows, 2)].reshape(1, -1, 160)  # batched rows [1, N, in] as nn.Linear takes them
    torch.testing.assert_close(cpu_linear.linear(x3, weight, b), torch_ops.linear(x3, weight, b), atol=2e-5, rtol=2e-5)


def test_install_turns_plain_linears_into_cpu_linears_with_the_same_parameters():
    g = torch.Generator().manual_seed(14)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g)
    x = torch.randn(5, 16, generator=g)
    with torch.inference_mode():
        expected = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert cpu_linear.install(model) == 2
    assert all(isinstance(m, cpu_linear.CpuLinear) for m in (model[0], model[2]))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, atol=2e-5, rtol=2e-5)
    assert cpu_linear.install(model) == 0  # already CpuLinear: nothing left to turn


@pytest.mark.parametrize("rows", [1, 8, 127, 128, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_linear_matches_the_twin(rows, dtype):
    """Below FUSED_MLP_MIN_ROWS one GEMM and the twin's activation; from it on the activation fused into two GEMMs."""
    g = torch.Generator().manual_seed(15)
    weight = (torch.randn(2 * 48, 160, generator=g) / 160**0.5).to(dtype)
    x = (torch.randn(rows, 160, generator=g) * 2).to(dtype)
    got = cpu_linear.silu_and_mul_linear(x, weight)
    want = torch_ops.silu_and_mul(torch_ops.linear(x, weight))
    assert got.dtype == dtype and got.shape == (rows, 48)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_linear_defers_to_f_linear_under_a_torch_function_mode():
    """The runner's batch-invariant mode replaces F.linear through a TorchFunctionMode: it must still see the call."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x, weight = torch.randn(3, 8), torch.randn(4, 8)
    with Spy():
        cpu_linear.linear(x, weight)
    assert torch.nn.functional.linear in seen
