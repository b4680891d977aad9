"""Causal attention of a long prompt as blocks of query rows on torch's matmuls: the CPU's bf16 prefill.

torch 2.13's CPU flash kernel does not use the bf16 dot-product instructions (it runs no faster in bfloat16 than in
float32), while its bf16 matmuls run about twice float32's. So for a long prompt in bfloat16, per block of Bq query
rows and per KV head, the query heads of that KV head stacked as rows (GQA without repeating K/V):

    q_blk [Hkv, group * Bq, D] (scaled) @ k[lo:end]^T  -> scores [Hkv, group * Bq, end - lo]   (bmm)
    softmax over the keys (computed in float32 inside the kernel) -> probs in q's dtype
    probs @ v[lo:end]                                  -> [Hkv, group * Bq, D]                  (bmm)

            keys 0 ..................... P+i0 ... end = P+i1
    block i0..i1  [ every key seen      | diag  ]          only the diagonal block [Bq, Bq] is masked
                  <- lo (a window's first key)             (and, under a window, its band's lower edge)

The queries sit at the end of the keys (P = S - Q cached keys before them): a cold prompt (P = 0), a chunk over a
cached prefix (bottom-right causal) and a sliding window are one loop. Scores never exceed one block's rows.
"""

from __future__ import annotations

import torch

#: Query rows per block: 64-256 within noise of each other at 2k-8k keys, 128 ahead at 8k (bench/cpu/cpu_attention.py,
#: docs/cpu.md; the runs: docs/journal/cpu-2026-12.md).
BLOCK_Q = 128

#: Below this many keys per query the flash kernel is as fast (bfloat16, one thread: 0.8x at 64 keys, ~1x at 128,
#: 1.3-1.5x at 256); float32 never wins (0.5-0.9x: float32 matmuls are no faster than the flash kernel).
MIN_KEYS = 256


def wins(dtype: torch.dtype, num_keys_seen: int) -> bool:
    """Whether a prefill row over num_keys_seen keys (the window's width where a window is shorter) goes here."""
    return dtype == torch.bfloat16 and num_keys_seen >= MIN_KEYS


def blocked_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    block_q: int | None = None,
) -> torch.Tensor:
    """q [1, Hq, Q, D] over k/v [1, Hkv, S, D], Q <= S, queries aligned to the end of the keys -> [1, Hq, Q, D];
    query at position p sees keys (p - sliding_window, p] (all keys <= p without a window); block_q: BLOCK_Q
    unless given."""
    block_q = block_q or BLOCK_Q
    _, num_heads, num_queries, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    assert num_heads % num_kv_heads == 0 and num_queries <= num_keys, (q.shape, k.shape)
    group, prefix = num_heads // num_kv_heads, num_keys - num_queries
    # [Hkv, D, S]: each block's scores one plain GEMM, no copy of K per block (the gather's rows are [S, Hkv, D])
    keys_t = k[0].transpose(1, 2).contiguous()
    values = v[0].contiguous()  # [Hkv, S, D]
    queries = (q[0] * scale).view(num_kv_heads, group, num_queries, head_dim)  # head h -> KV head h // group
    out = q.new_empty(num_kv_heads, group, num_queries, head_dim)
    # hidden in the diagonal block: a key after its query
    above = torch.ones(block_q, block_q, dtype=torch.bool, device=q.device).triu_(1)
    for start in range(0, num_queries, block_q):
        rows = min(block_q, num_queries - start)
        end = prefix + start + rows  # one past the block's last key
        first = 0 if sliding_window is None else max(0, prefix + start - sliding_window + 1)
        q_blk = queries[:, :, start : start + rows].reshape(num_kv_heads, group * rows, head_dim)
        scores = torch.bmm(q_blk, keys_t[:, :, first:end])  # [Hkv, group * rows, end - first]
        grid = scores.view(num_kv_heads, group, rows, end - first)
        if sliding_window is None:
            grid[..., end - first - rows :].masked_fill_(above[:rows, :rows], float("-inf"))
        else:
            q_pos = torch.arange(prefix + start, end, device=q.device)[:, None]
            k_pos = torch.arange(first, end, device=q.device)[None, :]
            grid.masked_fill_((k_pos > q_pos) | (q_pos - k_pos >= sliding_window), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        attended = torch.bmm(probs, values[:, first:end])  # [Hkv, group * rows, D]
        out[:, :, start : start + rows] = attended.view(num_kv_heads, group, rows, head_dim)
    return out.view(1, num_heads, num_queries, head_dim)
