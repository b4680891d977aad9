"""Paged attention through torch's fused SDPA kernels: the CPU's `paged_attention` and `mla_paged_attention`.

Same signatures and semantics as the torch twins (`torch_ops.paged_attention`, `torch_mla.mla_paged_attention`,
the reference the parity tests hold these to), without the twins' float32 scores [Hq, q_len, S], repeated K/V
and explicit masks. Per sequence, its context gathered from the paged cache once per layer:

    bfloat16 prompt rows over >= 256 keys       -> blocked_attention: blocks of query rows on bf16 matmuls, any
                                                   prefix or window (torch 2.13's flash kernel runs bf16 no faster
                                                   than float32; its matmuls run bf16 twice as fast)
    prompt rows, no cached prefix (q_len == S)  -> is_causal: the flash kernel skips the blocks above the diagonal
    prompt rows over a prefix P = S - q_len     -> the rows over keys [0, P) unmasked and over keys [P, S) causal
                                                   (square: top-left = bottom-right), the two merged by their
                                                   log-sum-exps
    one row (a decode)                          -> every key, no mask, the query heads of a KV head as one block
    a sliding window shorter than S             -> the keys of the window only (only the blocks a row can see
                                                   are gathered), a boolean band mask

A step's decode rows (q_len == 1) take one gather and one call: the gather indices built by the first layer (the
step's `_DecodePlan`, kept in `meta.layer_shared`) land the context heads-first and contiguous, padded to the
longest row and masked only when the lengths differ. GQA goes through the kernel (query heads grouped over the KV
heads, no repeat), in the cache's dtype: the kernel accumulates in float32 itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.kernels import blocked_attention, torch_mla, torch_ops
from deepinfer.kernels.metadata import AttentionMetadata

#: The CPU flash kernel behind F.scaled_dot_product_attention, called directly where its second output, the
#: log-sum-exp of each row's scores [B, Hq, q_len] (float32), merges two halves of one row's keys. It handles GQA
#: (Hq a multiple of Hkv) itself. Never call it with zero queries or keys: it divides by the length.
_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """q [1, Hq, Q, D] over k/v [1, Hkv, S, D], Q <= S, queries aligned to the end of the keys -> [1, Hq, Q, D]:
    blocked_attention where it wins (bfloat16 prompt rows over enough keys), the fused kernels elsewhere."""
    num_queries, num_keys = q.shape[2], k.shape[2]
    keys_seen = num_keys if sliding_window is None else min(num_keys, sliding_window)
    if num_queries > 1 and q.device.type == "cpu" and blocked_attention.wins(q.dtype, keys_seen):
        return blocked_attention.blocked_causal_attention(q, k, v, scale, sliding_window)
    return fused_causal_attention(q, k, v, scale, sliding_window)


def fused_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """causal_attention through torch's fused SDPA kernels only (flash on the CPU)."""
    num_queries, num_keys = q.shape[2], k.shape[2]
    prefix = num_keys - num_queries  # P: keys every query sees
    if sliding_window is not None and num_keys > sliding_window:
        return _windowed(q, k, v, scale, sliding_window)
    if num_queries == 1:
        return single_query_attention(q, k, v, scale)
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if q.device.type != "cpu":  # the kernel with the log-sum-exps is the CPU's: a bottom-right mask elsewhere
        q_pos = torch.arange(prefix, num_keys, device=q.device)[:, None]
        causal = torch.arange(num_keys, device=q.device)[None, :] <= q_pos
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=True)
    out_prefix, lse_prefix = _flash_with_lse(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)
    out_diag, lse_diag = _flash_with_lse(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)
    # softmax over both halves = each half's softmax weighted by its share of the exp-sum: sigmoid(lse_p - lse_d)
    share = torch.sigmoid(lse_prefix - lse_diag).unsqueeze(-1)  # [1, Hq, Q, 1] float32
    return out_diag.float().lerp_(out_prefix.float(), share).to(q.dtype)


def single_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """One query row per sequence: q [B, Hq, 1, D] over k/v [B, Hkv, S, D] -> [B, Hq, 1, D]; key_mask [B, S] bool
    (True = attend) or None. The query heads of one KV head go in as the rows of one block, [B, Hkv, group, D]:
    the kernel then reads each KV head's keys once for its whole group, not once per query head."""
    batch, num_heads, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # head h -> KV head h // group
    mask = None if key_mask is None else key_mask[:, None, None, :]  # [B, 1, 1, S]
    attended = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return attended.reshape(batch, num_heads, 1, head_dim)


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """causal_attention when a window hides keys: query at position p sees keys (p - window, p]."""
    num_queries, num_keys = q.shape[2], k.shape[2]
    first = max(0, num_keys - num_queries - window + 1)  # no query sees a key before this one
    k, v = k[:, :, first:], v[:, :, first:]
    if num_queries == 1:
        return single_query_attention(q, k, v, scale)
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=q.device)[:, None]
    k_pos = torch.arange(first, num_keys, device=q.device)[None, :]
    band = (k_pos <= q_pos) & (q_pos - k_pos < window)  # [Q, S - first]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scale, enable_gqa=True)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [1, H, T, D] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The cache's blocks block_ids [N] (int64) as rows: [2, N * block_size, Hkv, D]. One index_select over whole
    blocks along dim 0 (K's then V's): copies of contiguous block_size * Hkv * D runs, split over the threads,
    2-3x faster on the CPU than advanced indexing."""
    _, num_blocks, _, num_kv_heads, head_dim = kv_cache.shape
    both = torch.cat((block_ids, block_ids + num_blocks))
    return kv_cache.view(2 * num_blocks, -1).index_select(0, both).view(2, -1, num_kv_heads, head_dim)


@dataclass(frozen=True)
class _DecodePlan:
    """One step's gather of its single-row sequences, built by the first layer, shared by the others.

        row_ids [2 * R * Hkv * S]: for K then V (kv = 0, 1), row r, KV head h, key p (of its window under a
        sliding window: position first_r + p), the index of that
        vector of D elements in kv_cache.view(-1, D): kv * num_slots * Hkv + slot(r, p) * Hkv + h, where
        slot = block * block_size + p % block_size -> one index_select along dim 0 (split over the threads) lands
        the context heads-first and contiguous, [2, R, Hkv, S, D], as the kernel likes it
    """

    # What the plan was built from, compared by value: graph runners rewrite static metadata in place each step.
    seq_lens: list[int]
    query_start_loc: list[int]
    block_tables: torch.Tensor  # a copy
    token_rows: torch.Tensor  # [R] the rows' indices in the flat batch
    row_ids: torch.Tensor  # [2 * R * Hkv * S] int64
    key_mask: torch.Tensor | None  # [R, S] bool, True = attend; None when every row sees all S keys
    num_keys: int  # S: the most keys a row sees (its context, or its window)


def _decode_plan(
    meta: AttentionMetadata, rows: list[int], kv_cache: torch.Tensor, sliding_window: int | None
) -> _DecodePlan:
    """The step's plan for the single-row sequences `rows` over caches shaped like kv_cache (built once a step)."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    key = ("decode_rows", block_size, num_kv_heads, sliding_window)
    plan = meta.layer_shared.get(key)
    if (plan is not None and plan.seq_lens == meta.seq_lens_cpu and plan.query_start_loc == meta.query_start_loc_cpu
            and torch.equal(plan.block_tables, meta.block_tables)):
        return plan
    device = kv_cache.device
    seq_lens = [meta.seq_lens_cpu[b] for b in rows]
    # A row sees keys [first, seq_len): all of them, or under a window the last sliding_window (gathered alone).
    firsts = [0 if sliding_window is None else max(0, n - sliding_window) for n in seq_lens]
    spans = [n - first for n, first in zip(seq_lens, firsts, strict=True)]
    num_keys = max(spans)
    tables = meta.block_tables[torch.tensor(rows, device=device)].long()  # [R, max_blocks], padded with block 0
    pos = torch.arange(num_keys, device=device)
    if any(firsts):
        at = torch.tensor(firsts, device=device)[:, None] + pos[None, :]  # [R, S]: key j of row r's window
        columns = (at // block_size).clamp_(max=tables.shape[1] - 1)  # past a row's end: padding, masked
        slots = tables.gather(1, columns) * block_size + at % block_size
    else:
        slots = tables[:, pos // block_size] * block_size + pos % block_size  # [R, S]
    k_ids = (slots[:, None, :] * num_kv_heads + torch.arange(num_kv_heads, device=device)[None, :, None]).flatten()
    row_ids = torch.cat((k_ids, k_ids + kv_cache[0].numel() // kv_cache.shape[4]))  # V's rows follow K's
    key_mask = None
    if min(spans) < num_keys:
        # the row's own token is its key spans - 1; past it: padding
        key_mask = pos[None, :] < torch.tensor(spans, device=device)[:, None]
    token_rows = torch.tensor([meta.query_start_loc_cpu[b] for b in rows], device=device)
    plan = _DecodePlan(list(meta.seq_lens_cpu), list(meta.query_start_loc_cpu), meta.block_tables.clone(), token_rows,
                       row_ids, key_mask, num_keys)
    meta.layer_shared[key] = plan
    return plan


def _decode_rows(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    rows: list[int],
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The single-row sequences `rows` in one gather and one call: their keys padded to the longest and masked,
    unless every row has the same length and no window hides a key. Into out's rows; with out None (a batch of
    decodes only, no padding rows) the attention itself, [R, Hq, D]."""
    plan = _decode_plan(meta, rows, kv_cache, sliding_window)
    num_rows, num_kv_heads, head_dim = len(rows), kv_cache.shape[3], kv_cache.shape[4]
    context = kv_cache.view(-1, head_dim).index_select(0, plan.row_ids)
    k, v = context.view(2, num_rows, num_kv_heads, plan.num_keys, head_dim)  # [R, Hkv, S, D] each
    q = query.unsqueeze(2) if out is None else query[plan.token_rows].unsqueeze(2)  # [R, Hq, 1, D]
    attended = single_query_attention(q, k, v, scale, plan.key_mask).squeeze(2)
    if out is None:
        return attended
    out[plan.token_rows] = attended
    return out


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`torch_ops.paged_attention` through the fused kernels (module docstring); padding rows come back zero."""
    torch_ops.check_attention_call(query, kv_cache, meta)
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    decode_rows = [b for b in range(len(seq_lens)) if starts[b + 1] - starts[b] == 1]
    if decode_rows and len(decode_rows) == len(seq_lens) == query.shape[0]:  # decodes only, no padding rows
        return _decode_rows(query, kv_cache, meta, scale, sliding_window, decode_rows, None)
    out = torch.zeros_like(query)
    if decode_rows:
        _decode_rows(query, kv_cache, meta, scale, sliding_window, decode_rows, out)
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end - q_start <= 1:  # empty, or a decode row (done above)
            continue
        assert q_end - q_start <= seq_len, f"sequence {b}: {q_end - q_start} new tokens but seq_len {seq_len}"
        block_size = kv_cache.shape[2]
        num_blocks = -(-seq_len // block_size)
        # Under a window, from the block of the first key any of these rows sees (the keys before: never read).
        first_block = 0 if sliding_window is None else max(0, seq_len - (q_end - q_start) - sliding_window + 1) // block_size
        k, v = _gather(kv_cache, meta.block_tables[b, first_block:num_blocks].long())[:, :seq_len - first_block * block_size]
        attended = causal_attention(_heads_first(query[q_start:q_end]), _heads_first(k), _heads_first(v), scale,
                                    sliding_window)
        out[q_start:q_end] = attended[0].transpose(0, 1)
    return out


class AttentionPlan(torch_ops.AttentionPlan):
    """The twin's plan over this module's `paged_attention` (the CPU's piecewise-graph tests run it)."""

    def __call__(self, kv_cache: torch.Tensor, scale: float, sliding_window: int | None = None) -> None:
        """Write the attention of this step over `kv_cache` (one layer's) into `out`."""
        self.out.copy_(paged_attention(self.query, kv_cache, self.meta, scale, sliding_window))


def mla_paged_attention(
    query: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """`torch_mla.mla_paged_attention` through the fused kernels: one shared KV head, K = V = the latent row (the
    output's first kv_lora_rank columns are the attention over V = row[:kv_lora_rank])."""
    torch_mla.check_mla_attention_call(query, latent_cache, meta)
    starts = meta.query_start_loc_cpu
    out = query.new_zeros(query.shape[0], query.shape[1], kv_lora_rank)
    for b, seq_len in enumerate(meta.seq_lens_cpu):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start:
            continue
        assert q_end - q_start <= seq_len, f"sequence {b}: {q_end - q_start} new tokens but seq_len {seq_len}"
        rows = torch_mla.context_rows(latent_cache, meta.block_tables[b], seq_len)[None, None]  # [1, 1, S, C]
        attended = causal_attention(_heads_first(query[q_start:q_end]), rows, rows, scale)
        out[q_start:q_end] = attended[0, :, :, :kv_lora_rank].transpose(0, 1)
    return out
