"""Mistral: the Llama layout, with sliding-window attention when config.json sets one."""

from __future__ import annotations

from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import AttentionOptions
from deepinfer.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral 7B v0.1+ (v0.1 has a 4096-token window; later versions have none)."""

    @classmethod
    def attention_options(cls, config: ModelConfig) -> AttentionOptions:
        """No biases; the window, if any, masks keys older than `sliding_window` positions."""
        return AttentionOptions(sliding_window=config.sliding_window)
