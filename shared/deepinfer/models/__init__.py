"""Model definitions (Llama family) over the paged KV cache; `ModelConfig` and the registry import no torch."""

from deepinfer.models.config import ModelConfig
from deepinfer.models.registry import get_model_class, supported_architectures

__all__ = ["ModelConfig", "get_model_class", "supported_architectures"]
