"""MoE: the grouped twin against a per-token loop, and V2/V3 routing against transformers' routers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels.torch_moe import fused_moe
from deepinfer.models.config import MoeConfig
from deepinfer.models.deepseek_moe import route_sigmoid_grouped, route_softmax_topk, routing_strategy


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    torch.manual_seed(0)


def naive_moe(hidden, w13, w2, topk_weights, topk_ids):
    """One token and one chosen expert at a time."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate, up = (w13[e] @ hidden[t]).chunk(2)
            out[t] += topk_weights[t, k] * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (13, 8, 2), (40, 16, 6), (7, 3, 3)])
def test_grouped_moe_matches_per_token_loop(num_tokens, num_experts, top_k):
    hidden_size, inter = 24, 20
    hidden = torch.randn(num_tokens, hidden_size)
    w13 = torch.randn(num_experts, 2 * inter, hidden_size) * 0.3
    w2 = torch.randn(num_experts, hidden_size, inter) * 0.3
    topk_ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    topk_weights = torch.rand(num_tokens, top_k)
    out = fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(out, naive_moe(hidden, w13, w2, topk_weights, topk_ids), rtol=1e-5, atol=1e-5)


def _v3_config(**kw) -> MoeConfig:
    base = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=8, scoring_func="sigmoid",
                topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    return MoeConfig(**{**base, **kw})


def _sorted_pairs(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_v3_routing_matches_transformers(norm_topk_prob):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = _v3_config(norm_topk_prob=norm_topk_prob)
    hf = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5,
    ))
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
        hf.e_score_correction_bias.normal_(0, 0.2)
    hidden = torch.randn(50, 32)
    logits = hidden @ hf.weight.T
    ours = route_sigmoid_grouped(logits, hf.e_score_correction_bias, config)
    _, ref_weights, ref_ids = hf(hidden)
    for a, b in zip(_sorted_pairs(*ours), _sorted_pairs(ref_weights, ref_ids), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_v3_bias_steers_selection_but_not_weights():
    config = _v3_config(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    logits = torch.randn(30, 16)
    bias = torch.zeros(16)
    bias[3] = 10.0  # expert 3 always chosen, weighted by its own sigmoid score only
    weights, ids = route_sigmoid_grouped(logits, bias, config)
    assert (ids == 3).any(dim=-1).all()
    chosen = weights[ids == 3]
    torch.testing.assert_close(chosen, logits[:, 3].sigmoid())


def test_v3_group_limit_keeps_experts_in_best_groups():
    config = _v3_config()
    logits = torch.randn(64, 16) * 3
    _, ids = route_sigmoid_grouped(logits, torch.zeros(16), config)
    groups = ids // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_v2_routing_matches_transformers(topk_method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = MoeConfig(num_experts=16, num_experts_per_tok=3, moe_intermediate_size=8, topk_method=topk_method,
                       n_group=4, topk_group=2, routed_scaling_factor=16.0)
    assert routing_strategy(config) is route_softmax_topk
    hf = DeepseekV2TopkRouter(DeepseekV2Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
        topk_method=topk_method, routed_scaling_factor=16.0,
    ))
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
    hidden = torch.randn(50, 32)
    ours = route_softmax_topk(hidden @ hf.weight.T, torch.zeros(16), config)
    _, ref_weights, ref_ids = hf(hidden)
    for a, b in zip(_sorted_pairs(*ours), _sorted_pairs(ref_weights, ref_ids), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)


def test_unknown_routing_is_refused():
    with pytest.raises(ValueError, match="scoring_func"):
        routing_strategy(MoeConfig(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=4,
                                   scoring_func="relu"))
