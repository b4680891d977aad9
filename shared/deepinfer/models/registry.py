"""HF `architectures[0]` -> our model class, imported only when asked for (listing needs no torch)."""

from __future__ import annotations

import importlib
from typing import Any

#: architecture -> "module:Class".
_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "deepinfer.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "deepinfer.models.deepseek:DeepseekV3ForCausalLM",
    "Gemma3ForCausalLM": "deepinfer.models.gemma3:Gemma3ForCausalLM",
    "LlamaForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "deepinfer.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "deepinfer.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "deepinfer.models.qwen3:Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    """Architectures we can build, sorted."""
    return sorted(_ARCHITECTURES)


def check_architecture(architecture: str) -> None:
    """Raise ValueError naming the architecture and the supported ones if we cannot build it."""
    if architecture not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )


def get_model_class(architecture: str) -> Any:
    """The nn.Module class for an HF architecture name; ValueError if unsupported."""
    check_architecture(architecture)
    module_name, _, class_name = _ARCHITECTURES[architecture].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
