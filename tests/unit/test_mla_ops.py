"""MLA torch twins on random inputs: latent cache write, absorbed attention over the paged latent cache, varlen
attention, absorbed == naive at the module level, and latent block export/import."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.kv_transfer import block_nbytes, export_blocks, import_blocks, kv_layout_of
from deepinfer.kernels import build_attention_metadata
from deepinfer.kernels.torch_mla import (
    gather_latent,
    mla_cache_write,
    mla_paged_attention,
    select_sequences,
    varlen_causal_attention,
)

KV_LORA_RANK, ROPE_DIM, BLOCK_SIZE, NUM_BLOCKS = 24, 8, 4, 32
LATENT = KV_LORA_RANK + ROPE_DIM


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    torch.manual_seed(0)


def _batch(query_lens: list[int], seq_lens: list[int]):
    """Metadata with shuffled, non-contiguous block tables, and the dense context of each sequence."""
    perm = (torch.randperm(NUM_BLOCKS - 1) + 1).tolist()
    tables, slots = [], []
    for q_len, seq_len in zip(query_lens, seq_lens, strict=True):
        table = [perm.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        tables.append(table)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len - q_len, seq_len)]
    return build_attention_metadata(query_lens, seq_lens, tables, slots)


def _fill_context(cache, meta, contexts):
    """Write every sequence's full context rows (prefix included) straight into its slots."""
    for b, rows in enumerate(contexts):
        table = meta.block_tables[b].tolist()
        for p, row in enumerate(rows):
            cache[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = row


def _dense_reference(query, contexts, meta, scale):
    out = torch.zeros(query.shape[0], query.shape[1], KV_LORA_RANK)
    starts = meta.query_start_loc_cpu
    for b, rows in enumerate(contexts):
        seq_len, q = len(rows), query[starts[b] : starts[b + 1]]
        for i in range(q.shape[0]):
            pos = seq_len - q.shape[0] + i
            probs = torch.softmax((q[i] @ rows[: pos + 1].T) * scale, dim=-1)  # [H, pos + 1]
            out[starts[b] + i] = probs @ rows[: pos + 1, :KV_LORA_RANK]
    return out


@pytest.mark.parametrize(
    "query_lens,seq_lens", [([1], [9]), ([5, 1, 3], [5, 14, 19]), ([1, 1, 1], [3, 17, 8]), ([7, 2], [7, 11])]
)
def test_mla_paged_attention_matches_dense(query_lens, seq_lens):
    meta = _batch(query_lens, seq_lens)
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, LATENT) * 10  # junk: unread slots must not matter
    contexts = [torch.randn(n, LATENT) for n in seq_lens]
    _fill_context(cache, meta, contexts)
    query = torch.randn(sum(query_lens) + 2, 3, LATENT)  # two padding rows past the batch
    out = mla_paged_attention(query, cache, meta, 0.2, KV_LORA_RANK)
    torch.testing.assert_close(out, _dense_reference(query, contexts, meta, 0.2), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))


def test_cache_write_places_rows_and_skips_padding():
    meta = _batch([3, 2], [6, 2])
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, LATENT)
    kv_c, k_pe = torch.randn(6, KV_LORA_RANK), torch.randn(6, ROPE_DIM)
    slots = torch.cat((meta.slot_mapping, torch.tensor([-1])))
    mla_cache_write(kv_c, k_pe, cache, slots)
    flat = cache.view(-1, LATENT)
    torch.testing.assert_close(flat[meta.slot_mapping], torch.cat((kv_c, k_pe), -1)[:5], rtol=0, atol=0)
    assert int((flat.abs().sum(-1) > 0).sum()) == 5


def test_gather_and_varlen_match_dense_reference():
    meta = _batch([4, 3], [9, 3])
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, LATENT)
    contexts = [torch.randn(n, LATENT) for n in (9, 3)]
    _fill_context(cache, meta, contexts)
    latent, cu_k = gather_latent(cache, meta)
    assert cu_k == [0, 9, 12]
    torch.testing.assert_close(latent, torch.cat(contexts), rtol=0, atol=0)
    # varlen attention with K = the rows and V = their first KV_LORA_RANK columns, one shared head repeated
    query = torch.randn(7, 2, LATENT)
    key = latent[:, None].expand(-1, 2, -1)
    value = latent[:, None, :KV_LORA_RANK].expand(-1, 2, -1)
    out = varlen_causal_attention(query, key, value, meta.query_start_loc_cpu, cu_k, 0.3)
    torch.testing.assert_close(out, _dense_reference(query, contexts, meta, 0.3), rtol=1e-5, atol=1e-5)


def test_select_sequences_keeps_rows_and_tables():
    meta = _batch([3, 1, 4], [3, 10, 6])
    sub, rows = select_sequences(meta, [0, 2])
    assert rows.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert sub.query_start_loc_cpu == [0, 3, 7] and sub.seq_lens_cpu == [3, 6]
    assert torch.equal(sub.block_tables, meta.block_tables[[0, 2]])
    assert torch.equal(sub.slot_mapping, meta.slot_mapping[rows])


def test_absorbed_equals_naive_in_the_module():
    """The same MLA layer run with every row through the absorbed path and through the naive path."""
    from deepinfer.kernels import get_ops
    from deepinfer.models.config import MlaConfig, ModelConfig
    from deepinfer.models.layers import RotaryEmbedding
    from deepinfer.models.mla import MlaAttention

    config = ModelConfig(
        architecture="DeepseekV2ForCausalLM", model_type="deepseek_v2", vocab_size=16, hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        max_position_embeddings=64,
        mla=MlaConfig(kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=12, qk_rope_head_dim=ROPE_DIM, v_head_dim=10),
    )
    ops = get_ops("cpu")
    attn = MlaAttention(config, ops, RotaryEmbedding(config, ROPE_DIM, ops))
    with torch.no_grad():
        for param in attn.parameters():
            param.normal_(0.0, 0.3)
    meta = _batch([5, 2], [5, 9])
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, LATENT)
    _fill_context(cache, meta, [torch.randn(5, LATENT), torch.randn(9, LATENT)])
    q_nope, q_pe = torch.randn(7, 4, 12), torch.randn(7, 4, ROPE_DIM)
    with torch.no_grad():
        absorbed = attn._absorbed(q_nope, q_pe, cache, meta)
        naive = attn._naive(q_nope, q_pe, cache, meta)
    torch.testing.assert_close(absorbed, naive, rtol=1e-4, atol=1e-5)


def test_latent_blocks_export_import_roundtrip():
    caches = [torch.randn(NUM_BLOCKS, BLOCK_SIZE, LATENT) for _ in range(3)]
    layout = kv_layout_of(caches, BLOCK_SIZE)
    assert layout.latent_dim == LATENT and layout.kv_layout == "latent" and layout.num_layers == 3
    assert block_nbytes(caches) == 3 * BLOCK_SIZE * LATENT * 4
    payloads = export_blocks(caches, [5, 2])
    assert all(len(p) == block_nbytes(caches) for p in payloads)
    targets = [torch.zeros_like(c) for c in caches]
    import_blocks(targets, [7, 1], payloads)
    for src, dst in zip(caches, targets, strict=True):
        assert torch.equal(dst[7], src[5]) and torch.equal(dst[1], src[2])
        assert dst[3].abs().sum() == 0


@pytest.mark.parametrize(("q_lens", "k_lens"), [([5, 1, 7], [5, 4, 7]), ([3, 0, 2], [10, 0, 2])])
def test_sdpa_varlen_matches_the_twin(q_lens, k_lens):
    """The fused-SDPA override (cold prompts: is_causal; cached prefixes: bottom-right mask; V narrower than QK)."""
    from deepinfer.kernels.sdpa_varlen import varlen_causal_attention as sdpa_varlen

    g = torch.Generator().manual_seed(5)
    cu_q, cu_k = [0], [0]
    for q_len, k_len in zip(q_lens, k_lens, strict=True):
        cu_q.append(cu_q[-1] + q_len)
        cu_k.append(cu_k[-1] + k_len)
    query = torch.randn(cu_q[-1] + 2, 3, 24, generator=g)  # 2 padding rows past cu_q[-1]
    key, value = torch.randn(cu_k[-1], 3, 24, generator=g), torch.randn(cu_k[-1], 3, 16, generator=g)
    out = sdpa_varlen(query, key, value, cu_q, cu_k, 0.2)
    torch.testing.assert_close(out, varlen_causal_attention(query, key, value, cu_q, cu_k, 0.2), rtol=1e-5,
                               atol=1e-5)
    assert not out[cu_q[-1]:].any()
