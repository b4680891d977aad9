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

from deepinfer.kernels.torch_mla import ragged_sequences


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
    assert value.shape[2] <= query.shape[2], f"V width {value.shape[2]} exceeds the QK width {query.shape[2]}"
    head_dim_v, pad = value.shape[2], query.shape[2] - value.shape[2]
    out = query.new_zeros(query.shape[0], query.shape[1], head_dim_v)
    for (q_start, q_end), (k_start, k_end) in ragged_sequences(query, key, value, cu_seqlens_q, cu_seqlens_k):
        q_len, k_len = q_end - q_start, k_end - k_start
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
