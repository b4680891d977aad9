"""Torch twin of the fused MoE op: grouped expert execution (sort tokens by expert, one matmul per expert).

Expert weights are stacked as the fused kernel wants them: `w13 [E, 2I, H]` (gate rows then up rows) and
`w2 [E, H, I]`; routing gives `topk_ids [T, k]` and `topk_weights [T, k]` (float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) for hidden [T, H] -> [T, H] in hidden.dtype.

    Each expert is SwiGLU: w2 · (silu(gate) * up) with [gate; up] = w13 · x. Accumulates in float32.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    assert w13.shape == (num_experts, two_inter, hidden_size) and two_inter % 2 == 0, (
        f"w13 must be [E, 2I, {hidden_size}], got {tuple(w13.shape)}"
    )
    assert w2.shape == (num_experts, hidden_size, two_inter // 2), (
        f"w2 must be [{num_experts}, {hidden_size}, {two_inter // 2}], got {tuple(w2.shape)}"
    )
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens, (
        f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must be [T={num_tokens}, k]"
    )
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        gate, up = F.linear(hidden[tokens], w13[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, expert_out.float() * weight_of[start : start + count, None])
        start += count
    return out.to(hidden.dtype)
