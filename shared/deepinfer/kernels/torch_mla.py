"""Torch twins of the multi-head latent attention (MLA) ops over a paged latent cache.

Latent cache of one layer: `[num_blocks, block_size, latent_dim]` with latent_dim = kv_lora_rank +
qk_rope_head_dim: per token the normalised compressed KV latent `c_kv` then the rotated, head-shared RoPE key
`k_pe`. The slots and metadata are exactly those of the standard cache (`AttentionMetadata`).

    absorbed (decode): q = [q_nope · W_UK ‖ q_pe]  [T, H, latent_dim]; one shared "KV head" = the cache row;
                       V = the row's first kv_lora_rank elements; the caller maps the output through W_UV.
    naive (prefill):   gather each sequence's latent rows, the caller expands them through kv_b_proj to
                       per-head K/V, then `varlen_causal_attention` over contiguous K/V.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from deepinfer.kernels.metadata import AttentionMetadata


def _check_latent_cache(latent_cache: torch.Tensor) -> None:
    assert latent_cache.dim() == 3, (
        f"latent_cache must be [num_blocks, block_size, latent_dim], got {tuple(latent_cache.shape)}"
    )
    assert latent_cache.is_contiguous(), "latent_cache must be contiguous"


def check_cache_write(
    kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Assert the shapes and dtypes of an `mla_cache_write` call (shared with its Triton version)."""
    _check_latent_cache(latent_cache)
    latent_dim = latent_cache.shape[2]
    assert kv_c.dim() == 2 and k_pe.dim() == 2 and kv_c.shape[0] == k_pe.shape[0], (
        f"kv_c [T, C] and k_pe [T, R] expected, got {tuple(kv_c.shape)} and {tuple(k_pe.shape)}"
    )
    assert kv_c.shape[1] + k_pe.shape[1] == latent_dim, (
        f"kv_c width {kv_c.shape[1]} + k_pe width {k_pe.shape[1]} != latent_dim {latent_dim}"
    )
    assert kv_c.dtype == k_pe.dtype == latent_cache.dtype, (
        f"dtypes differ: kv_c {kv_c.dtype}, k_pe {k_pe.dtype}, cache {latent_cache.dtype}"
    )
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (kv_c.shape[0],), (
        f"slot_mapping must be [T={kv_c.shape[0]}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
    )


def mla_cache_write(
    kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write [kv_c ‖ k_pe] rows ([T, kv_lora_rank], [T, rope_dim]) into their slots; slot < 0 = padding."""
    check_cache_write(kv_c, k_pe, latent_cache, slot_mapping)
    latent_dim = latent_cache.shape[2]
    flat = latent_cache.view(-1, latent_dim)  # [num_slots, latent_dim]
    keep = slot_mapping >= 0
    flat.index_copy_(0, slot_mapping[keep], torch.cat((kv_c, k_pe), dim=-1)[keep])


def context_rows(latent_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first seq_len latent rows: [seq_len, latent_dim]."""
    block_size = latent_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return latent_cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def check_mla_attention_call(query: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Assert the shapes and dtypes of an `mla_paged_attention` call (shared with its CPU version, sdpa_paged)."""
    _check_latent_cache(latent_cache)
    assert query.dim() == 3 and query.shape[2] == latent_cache.shape[2], (
        f"query must be [T, H, {latent_cache.shape[2]}], got {tuple(query.shape)}"
    )
    assert query.dtype == latent_cache.dtype, f"query {query.dtype} vs latent_cache {latent_cache.dtype}"
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    assert len(starts) == len(seq_lens) + 1 and starts[-1] <= query.shape[0], (
        f"query_start_loc_cpu {starts} does not fit seq_lens_cpu {seq_lens} and T={query.shape[0]}"
    )


def mla_paged_attention(
    query: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """Absorbed MLA: query [T, H, latent_dim] against cache rows (K = row, V = row[:kv_lora_rank]).

    Causal over each sequence's context exactly as `paged_attention`; returns [T, H, kv_lora_rank] in
    query.dtype (float32 accumulation). Rows past query_start_loc[-1] come back as zeros.
    """
    check_mla_attention_call(query, latent_cache, meta)
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    out = query.new_zeros(query.shape[0], query.shape[1], kv_lora_rank)
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        assert q_len <= seq_len, f"sequence {b}: {q_len} new tokens but seq_len {seq_len}"
        rows = context_rows(latent_cache, meta.block_tables[b], seq_len).float()  # [S, latent_dim]
        q = query[q_start:q_end].float()  # [q_len, H, latent_dim]
        scores = torch.einsum("qhc,kc->hqk", q, rows) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,kc->qhc", probs, rows[:, :kv_lora_rank]).to(query.dtype)
    return out


def gather_latent(
    latent_cache: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, list[int]]:
    """Every sequence's context rows, concatenated: ([sum(seq_lens), latent_dim], cu_seqlens_k host list)."""
    _check_latent_cache(latent_cache)
    parts = [
        context_rows(latent_cache, meta.block_tables[b], seq_len) for b, seq_len in enumerate(meta.seq_lens_cpu)
    ]
    cu_seqlens_k = [0]
    for seq_len in meta.seq_lens_cpu:
        cu_seqlens_k.append(cu_seqlens_k[-1] + seq_len)
    if not parts:
        return latent_cache.new_zeros(0, latent_cache.shape[2]), cu_seqlens_k
    return torch.cat(parts), cu_seqlens_k


def ragged_sequences(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: Sequence[int],
    cu_seqlens_k: Sequence[int],
) -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
    """Check a varlen attention call's shapes; yield each sequence's (query rows, key rows), skipping q_len 0."""
    assert query.dim() == key.dim() == value.dim() == 3, "query/key/value must be [T, H, D]"
    assert key.shape[:2] == value.shape[:2] and query.shape[1:] == key.shape[1:], (
        f"shapes differ: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    )
    assert len(cu_seqlens_q) == len(cu_seqlens_k), "one cumulative length per sequence for q and k"
    for b in range(len(cu_seqlens_q) - 1):
        q_rows, k_rows = (cu_seqlens_q[b], cu_seqlens_q[b + 1]), (cu_seqlens_k[b], cu_seqlens_k[b + 1])
        q_len, k_len = q_rows[1] - q_rows[0], k_rows[1] - k_rows[0]
        assert q_len <= k_len, f"sequence {b}: {q_len} queries but {k_len} keys"
        if q_len:
            yield q_rows, k_rows


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: Sequence[int],
    cu_seqlens_k: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention over contiguous ragged K/V, queries aligned to the end of their keys (a cached prefix).

    query [Tq, H, Dqk], key [Tk, H, Dqk], value [Tk, H, Dv] -> [Tq, H, Dv] in query.dtype; rows past
    cu_seqlens_q[-1] come back as zeros.
    """
    out = query.new_zeros(query.shape[0], query.shape[1], value.shape[2])
    for (q_start, q_end), (k_start, k_end) in ragged_sequences(query, key, value, cu_seqlens_q, cu_seqlens_k):
        q_len, k_len = q_end - q_start, k_end - k_start
        q = query[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", q, key[k_start:k_end].float()) * scale
        q_pos = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
        k_pos = torch.arange(k_len, device=query.device)[None, :]
        probs = torch.softmax(scores.masked_fill(k_pos > q_pos, float("-inf")), dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, value[k_start:k_end].float()).to(query.dtype)
    return out


def select_sequences(meta: AttentionMetadata, seq_indices: Sequence[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of a subset of the batch's sequences, and the flat row index [T_sub] of their tokens."""
    starts = meta.query_start_loc_cpu
    device = meta.seq_lens.device
    rows: list[int] = []
    query_start_loc = [0]
    for b in seq_indices:
        rows.extend(range(starts[b], starts[b + 1]))
        query_start_loc.append(len(rows))
    index = torch.tensor(seq_indices, dtype=torch.long, device=device)
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    seq_lens = [meta.seq_lens_cpu[b] for b in seq_indices]
    sub = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=meta.seq_lens[index],
        block_tables=meta.block_tables[index],
        slot_mapping=meta.slot_mapping[row_index],
        max_query_len=max((query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_indices))), default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return sub, row_index
