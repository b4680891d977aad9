"""Qwen2 / Qwen2.5: the Llama layout with a bias on q/k/v (not on o)."""

from __future__ import annotations

from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import AttentionOptions
from deepinfer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 decoder; often ties embeddings (the small sizes)."""

    @classmethod
    def attention_options(cls, config: ModelConfig) -> AttentionOptions:
        """q/k/v carry a bias, o_proj does not."""
        return AttentionOptions(qkv_bias=True, o_bias=False)
