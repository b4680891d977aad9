"""Qwen3 (dense): per-head RMSNorm of q and k before RoPE, no q/k/v bias by default."""

from __future__ import annotations

from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import AttentionOptions
from deepinfer.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 decoder; head_dim is explicit in config.json (often != hidden / heads)."""

    @classmethod
    def attention_options(cls, config: ModelConfig) -> AttentionOptions:
        """q_norm/k_norm over head_dim; biases only when `attention_bias` is set."""
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)
