"""DeepSeek MoE: routing strategies (V2 softmax top-k, V3 sigmoid + bias grouped top-k), experts, shared experts.

The V2/V3 difference is only how scores are made and experts picked; everything else is one module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.kernels import KernelOps
from deepinfer.models.config import MoeConfig

#: (router_logits [T, E] f32, e_score_correction_bias [E] f32, config) -> (topk_weights [T, k] f32, topk_ids [T, k])
RouteFn = Callable[[torch.Tensor, torch.Tensor, MoeConfig], tuple[torch.Tensor, torch.Tensor]]


def _group_mask(scores_for_choice: torch.Tensor, config: MoeConfig, group_score: str) -> torch.Tensor:
    """[T, E] bool: experts in the topk_group best of n_group groups (group score: "max" or "top2sum")."""
    num_tokens, num_experts = scores_for_choice.shape
    grouped = scores_for_choice.view(num_tokens, config.n_group, num_experts // config.n_group)
    if group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:  # V3: sum of the two best experts of each group
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=config.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)


def route_softmax_topk(
    router_logits: torch.Tensor, bias: torch.Tensor, config: MoeConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """V2: softmax scores, top-k over all experts ("greedy") or within the best groups ("group_limited_greedy")."""
    del bias  # V2 has none
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if config.topk_method == "group_limited_greedy":
        scores = scores.masked_fill(~_group_mask(scores, config, "max"), 0.0)
    elif config.topk_method != "greedy":
        raise ValueError(f"topk_method {config.topk_method!r} does not go with softmax scoring")
    topk_weights, topk_ids = torch.topk(scores, k=config.num_experts_per_tok, dim=-1, sorted=False)
    if config.norm_topk_prob and config.num_experts_per_tok > 1:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * config.routed_scaling_factor, topk_ids


def route_sigmoid_grouped(
    router_logits: torch.Tensor, bias: torch.Tensor, config: MoeConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """V3 ("noaux_tc"): sigmoid scores; the correction bias steers selection only, weights come from the scores."""
    scores = router_logits.sigmoid()
    scores_for_choice = scores + bias
    scores_for_choice = scores_for_choice.masked_fill(~_group_mask(scores_for_choice, config, "top2sum"), -torch.inf)
    topk_ids = torch.topk(scores_for_choice, k=config.num_experts_per_tok, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if config.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * config.routed_scaling_factor, topk_ids


def routing_strategy(config: MoeConfig) -> RouteFn:
    """The routing function for a config's scoring_func / topk_method."""
    if config.scoring_func == "sigmoid":
        if config.topk_method != "noaux_tc":
            raise ValueError(f"sigmoid scoring with topk_method {config.topk_method!r} is not supported")
        return route_sigmoid_grouped
    if config.scoring_func == "softmax":
        return route_softmax_topk
    raise ValueError(f"scoring_func {config.scoring_func!r} is not supported (softmax or sigmoid)")


class GatedMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection (dense layers and shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class Router(nn.Module):
    """Router weight and (V3) score-correction bias, both kept in float32 whatever the model dtype."""

    def __init__(self, hidden_size: int, config: MoeConfig) -> None:
        super().__init__()
        self.config = config
        self.route_fn = routing_strategy(config)
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size), requires_grad=False)
        # Zeros for V2 (no bias in its checkpoints); a parameter so dummy loading and `to_empty` see it.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)

    @property
    def has_bias(self) -> bool:
        """True when the checkpoint carries e_score_correction_bias (sigmoid scoring)."""
        return self.config.scoring_func == "sigmoid"

    def _apply(self, fn, recurse=True):
        # Routing decisions flip on tiny score differences: keep the router in float32 after `.to(bf16)`.
        super()._apply(fn, recurse)
        for name in ("weight", "e_score_correction_bias"):
            param = getattr(self, name)
            if param.dtype != torch.float32:
                param.data = param.data.float()
        return self

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
        router_logits = nn.functional.linear(hidden.float(), self.weight)
        return self.route_fn(router_logits, self.e_score_correction_bias, self.config)


class DeepseekMoE(nn.Module):
    """Routed experts (stacked for the grouped/fused path) plus always-on shared experts."""

    def __init__(self, hidden_size: int, config: MoeConfig, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        self.fused_moe = ops.fused_moe  # Triton on CUDA, the torch twin elsewhere (deepinfer.kernels)
        inter = config.moe_intermediate_size
        self.gate = Router(hidden_size, config)
        # Named as transformers' fused experts: [E, 2I, H] gate rows then up rows, and [E, H, I].
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * inter, hidden_size))
        self.experts.down_proj = nn.Parameter(torch.empty(config.num_experts, hidden_size, inter))
        self.shared_experts = None
        if config.num_shared_experts:
            self.shared_experts = GatedMLP(hidden_size, inter * config.num_shared_experts, ops)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, H]."""
        topk_weights, topk_ids = self.gate(hidden)
        out = self.fused_moe(hidden, self.experts.gate_up_proj, self.experts.down_proj, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out
