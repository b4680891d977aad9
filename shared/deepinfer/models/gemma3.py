"""Gemma 3 (text): local sliding-window layers interleaved with global ones, each type with its own RoPE base.

What differs from the Llama layout (transformers' `modeling_gemma3.py` is the reference):

    embed * sqrt(hidden)            the scale rounded to the model's dtype first, as transformers does
    per layer                       residual stream h:
      x = input_layernorm(h)
      a = post_attention_layernorm(attn(x))       four norms: the attention and MLP outputs are normed too
      h = h + a
      m = post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
      h = h + m
    attn                            QK-norm over head_dim, scale query_pre_attn_scalar ** -0.5;
                                    "sliding_attention" layers: window sliding_window, RoPE base rope_local_base_freq;
                                    "full_attention" layers: no window, RoPE base rope_theta with rope_scaling
    mlp                             GeGLU: gelu_tanh(gate) * up
    norms                           x / rms(x) * (1 + weight): the checkpoint's weight is a zero-centred gain,
                                    folded into `1 + weight` once at load so the RMSNorm kernels run unchanged

In the PreNormBlock form (hidden, residual) with hidden + residual the true stream, the input norm and the
pre-feedforward norm are the fused add-then-norm; the two post norms are plain norms of a branch's output.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from deepinfer.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from deepinfer.kernels import KernelOps
from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import (
    MLP,
    Attention,
    AttentionOptions,
    DecoderStack,
    PreNormBlock,
    RMSNorm,
    RotaryEmbedding,
)
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.models.parallel import token_embedding

SLIDING_ATTENTION = "sliding_attention"
#: transformers' defaults for fields older Gemma 3 configs leave out.
_DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
_DEFAULT_LOCAL_ROPE_THETA = 10_000.0


def local_rope_theta(hf: dict[str, Any]) -> float:
    """The sliding layers' RoPE base: transformers 5.x `rope_parameters["sliding_attention"]`, else 4.x
    `rope_local_base_freq`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(SLIDING_ATTENTION), dict):
        local = params[SLIDING_ATTENTION]
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3 sliding layers with rope_type {local['rope_type']!r} are not supported")
        if "rope_theta" in local:
            return float(local["rope_theta"])
    return float(hf.get("rope_local_base_freq") or _DEFAULT_LOCAL_ROPE_THETA)


def check_gemma3_config(config: ModelConfig) -> None:
    """Raise ValueError for the Gemma 3 variants we do not run."""
    hf = config.hf_config
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("Gemma 3 with attn_logit_softcapping is not supported (our attention kernels do not cap "
                         "scores)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an encoder) is not supported")
    if config.sliding_window is None and SLIDING_ATTENTION in config.layer_types:
        raise ValueError("Gemma 3 config has sliding_attention layers but no sliding_window")


@functools.lru_cache(maxsize=8)
def embedding_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to `dtype` (bf16 makes sqrt(640) 25.25, not 25.30), as transformers scales."""
    return float(torch.tensor(hidden_size**0.5, dtype=dtype))


class GegluMLP(MLP):
    """gelu_tanh(gate) * up, with a fused gate/up projection (HF names gate_proj, up_proj, down_proj)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(PreNormBlock):
    """One Gemma 3 block: the PreNormBlock split plus the post-attention and post-feedforward norms."""

    def __init__(
        self,
        config: ModelConfig,
        ops: KernelOps,
        rotary: RotaryEmbedding,
        options: AttentionOptions,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, ops)
        self.self_attn = Attention(config, ops, rotary, options, tp)
        self.post_attention_layernorm = RMSNorm(size, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, ops)
        self.mlp = GegluMLP(config, ops, tp)
        self.post_feedforward_layernorm = RMSNorm(size, eps, ops)

    def _feed_forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden: the attention output; returns (normed MLP output, stream up to it)
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(DecoderStack):
    """Scaled embeddings, the local/global blocks and the final norm (HF's `model.` prefix)."""

    def __init__(
        self, config: ModelConfig, ops: KernelOps, options: AttentionOptions, tp: TensorParallelGroup = SINGLE_RANK
    ) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(config, tp)
        global_rotary = RotaryEmbedding(config, config.head_dim, ops)
        local_config = replace(config, rope_theta=local_rope_theta(config.hf_config), rope_scaling=None)
        local_rotary = RotaryEmbedding(local_config, config.head_dim, ops)
        local_options = replace(options, sliding_window=config.sliding_window)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, ops, local_rotary, local_options, tp)
            if layer_type == SLIDING_ATTENTION
            else Gemma3DecoderLayer(config, ops, global_rotary, options, tp)
            for layer_type in config.layer_types
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> embeddings * sqrt(hidden) [T, hidden], in the model's dtype."""
        hidden = self.embed_tokens(input_ids)
        return hidden * embedding_scale(hidden.shape[-1], hidden.dtype)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text decoder over the paged KV cache (tied embeddings in every released size)."""

    #: untested under tensor parallelism: a shard of it is refused rather than trusted.
    supports_tensor_parallel = False

    stack_class = Gemma3Model

    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        check_gemma3_config(config)
        if not config.layer_types:
            config = replace(config, layer_types=("full_attention",) * config.num_hidden_layers)
        super().__init__(config, ops, tp)
        #: tanh(logits / cap) * cap when the config sets final_logit_softcapping (Gemma 2 style), else None
        self.final_logit_softcapping = config.hf_config.get("final_logit_softcapping")

    @classmethod
    def attention_options(cls, config: ModelConfig) -> AttentionOptions:
        """QK-norm, the query_pre_attn_scalar scale, biases as `attention_bias`; the window is set per layer."""
        scalar = config.hf_config.get("query_pre_attn_scalar") or _DEFAULT_QUERY_PRE_ATTN_SCALAR
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True,
                                scale=float(scalar) ** -0.5)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32, soft-capped when the config asks."""
        logits = super().compute_logits(hidden)
        if self.final_logit_softcapping is None:
            return logits
        cap = float(self.final_logit_softcapping)
        return torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, each norm's zero-centred weight folded into its gain `1 + weight` (in float32,
        then cast to the parameter's dtype)."""
        super().load_weights(_fold_norm_gains(weights))


def _fold_norm_gains(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
        yield name, tensor
