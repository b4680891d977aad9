"""Llama 1-3.x (incl. llama3 RoPE scaling): the family's reference layout the other architectures reuse."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from deepinfer.distributed.layers import parallel_logits
from deepinfer.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from deepinfer.distributed.weights import FusedShards, load_sharded_hf_weights
from deepinfer.kernels import AttentionMetadata, KernelOps
from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import AttentionOptions, DecoderLayer, DecoderStack, RMSNorm, RotaryEmbedding
from deepinfer.models.parallel import lm_head, token_embedding
from deepinfer.models.weights import load_hf_weights


class DecoderModel(DecoderStack):
    """Embeddings, the decoder stack and the final norm (HF's `model.` prefix)."""

    def __init__(
        self, config: ModelConfig, ops: KernelOps, options: AttentionOptions, tp: TensorParallelGroup = SINGLE_RANK
    ) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(config, tp)
        rotary = RotaryEmbedding(config, config.head_dim, ops)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ops, rotary, options, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """Llama decoder over the paged KV cache; subclasses change only `attention_options`.

    With a `tp` group of several ranks this is one rank's shard (deepinfer.distributed): its heads, MLP columns
    and vocabulary rows; every rank returns the same hidden states and logits.
    """

    #: Builds with a TensorParallelGroup of any size (deepinfer.distributed).
    supports_tensor_parallel = True
    #: The stack under `model.`: (config, ops, attention options, tp) -> DecoderStack.
    stack_class: type[DecoderStack] = DecoderModel

    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.tp = tp
        self.model = self.stack_class(config, ops, self.attention_options(config), tp)
        # Tied models read the embedding matrix directly: no second parameter to keep tied.
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = lm_head(config, tp)

    @classmethod
    def attention_options(cls, config: ModelConfig) -> AttentionOptions:
        """Llama: optional bias on q/k/v/o (`attention_bias`), full attention."""
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions [T] int64 -> hidden states [T, hidden]; writes this step's K/V into kv_caches."""
        assert input_ids.dim() == 1 and input_ids.shape == positions.shape, (
            f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both be [T]"
        )
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp.world_size > 1:
            return parallel_logits(hidden, weight, self.tp, self.config.vocab_size)
        return self.ops.linear(hidden, weight).float()

    def fused_shards(self) -> FusedShards:
        """Our fused projections and the HF tensors stacked into each, in row order."""
        c = self.config
        q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return {
            "qkv_proj": (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)),
            "gate_up_proj": (("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)),
        }

    def ignores_weight(self, name: str) -> bool:
        """Checkpoint tensors that carry nothing we load (RoPE tables, a tied model's lm_head copy)."""
        if name.endswith("rotary_emb.inv_freq"):
            return True
        return self.lm_head is None and name == "lm_head.weight"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (a shard keeps its slice of each); unknown names, shape mismatches and missing
        tensors raise ValueError."""
        if self.tp.world_size > 1:
            load_sharded_hf_weights(self, weights, self.fused_shards(), self.ignores_weight)
        else:
            load_hf_weights(self, weights, self.fused_shards(), self.ignores_weight)

    def rebuild_buffers(self) -> None:
        """Recompute non-persistent buffers (the RoPE cache) after materialising from the "meta" device."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.rebuild_cache()
