"""The CPU's faster ops, with the torch twins' signatures: attention through torch's fused SDPA kernels.

Every other op stays its twin (torch_ops et al.): those already run as one or a few torch calls each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepinfer.kernels.sdpa_paged import AttentionPlan, mla_paged_attention, paged_attention
from deepinfer.kernels.sdpa_varlen import varlen_causal_attention


def overrides() -> dict[str, Callable[..., Any]]:
    """Op name -> CPU implementation, for `deepinfer.kernels.get_ops("cpu")`."""
    return {
        "paged_attention": paged_attention,
        "attention_plan": AttentionPlan,
        "mla_paged_attention": mla_paged_attention,
        "varlen_causal_attention": varlen_causal_attention,
    }
