"""Causal attention over contiguous ragged K/V through torch's fused SDPA kernels (flash / memory-efficient).

GPU override of `torch_mla.varlen_causal_attention` (same signature), used by MLA's prefill rows after the
latent rows are expanded to per-head K/V. Per sequence:

    q_len == k_len (cold prompt)  -> is_causal=True: the flash kernel
    q_len <  k_len (cached prefix) -> a bottom-right causal mask: query i sees keys <= k_len - q_len + i

V is zero-padded to the QK head dim when narrower (MLA: 128 vs 192) so the flash kernel applies; the pad
columns are sliced off the output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [1, H, T, D] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: Sequence[int],
    cu_seqlens_k: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """query [Tq, H, Dqk], key [Tk, H, Dqk], value [Tk, H, Dv] -> [Tq, H, Dv]; rows past cu_seqlens_q[-1] zero."""
    assert query.dim() == key.dim() == value.dim() == 3 and query.shape[1:] == key.shape[1:], (
        f"shapes differ: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    )
    assert key.shape[:2] == value.shape[:2] and value.shape[2] <= query.shape[2]
    assert len(cu_seqlens_q) == len(cu_seqlens_k), "one cumulative length per sequence for q and k"
    head_dim_v, pad = value.shape[2], query.shape[2] - value.shape[2]
    out = query.new_zeros(query.shape[0], query.shape[1], head_dim_v)
    for b in range(len(cu_seqlens_q) - 1):
        q_start, q_end = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        k_start, k_end = cu_seqlens_k[b], cu_seqlens_k[b + 1]
        q_len, k_len = q_end - q_start, k_end - k_start
        if q_len == 0:
            continue
        assert q_len <= k_len, f"sequence {b}: {q_len} queries but {k_len} keys"
        v = value[k_start:k_end]
        if pad:
            v = F.pad(v, (0, pad))
        q, k, v = _heads_first(query[q_start:q_end]), _heads_first(key[k_start:k_end]), _heads_first(v)
        if q_len == k_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            q_pos = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
            mask = torch.arange(k_len, device=query.device)[None, :] <= q_pos
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[q_start:q_end] = o[0].transpose(0, 1)[..., :head_dim_v]
    return out
