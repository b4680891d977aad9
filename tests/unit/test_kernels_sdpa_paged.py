"""The CPU's fused-SDPA attention (kernels.sdpa_paged) against the torch twins on random inputs: cold prompts,
prefix hits, chunked prefill, ragged decode batches, empty and padding rows, GQA, sliding windows, MLA."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import build_attention_metadata, get_ops, sdpa_paged, torch_mla, torch_ops


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


def test_paged_attention_bfloat16_stays_close_to_the_twin():
    cache, query, meta = _case([29, 12, 80, 40], [29, 1, 30, 1], 16, 8, 2, 32, torch.bfloat16, seed=5)
    out = sdpa_paged.paged_attention(query, cache, meta, 32**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch_ops.paged_attention(query, cache, meta, 32**-0.5).float(),
                               atol=2e-2, rtol=2e-2)


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


def test_get_ops_cpu_takes_the_fused_attention():
    ops = get_ops("cpu")
    assert ops.paged_attention is sdpa_paged.paged_attention
    assert ops.attention_plan is sdpa_paged.AttentionPlan
    assert ops.mla_paged_attention is sdpa_paged.mla_paged_attention
    assert ops.rms_norm is torch_ops.rms_norm  # the rest stay the twins
