"""Building blocks shared by the Llama-family models; all heavy math goes through `KernelOps`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from deepinfer.kernels import AttentionMetadata, KernelOps
from deepinfer.models.config import ModelConfig
from deepinfer.models.parallel import (
    config_head_shard,
    down_projection,
    gate_up_projection,
    o_projection,
    qkv_projection,
)
from deepinfer.models.rope import compute_cos_sin_cache


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; with a residual it is the fused add-then-norm."""

    def __init__(self, hidden_size: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rms_norm(x), or (rms_norm(x + residual), x + residual) when a residual is given."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin cache of one model (shared by all its layers) and applies RoPE through the ops."""

    def __init__(self, config: ModelConfig, rotary_dim: int, ops: KernelOps) -> None:
        super().__init__()
        self.config = config
        self.rotary_dim = rotary_dim
        self.ops = ops
        # float32 whatever the model dtype: positions up to ~1e5 need the mantissa.
        self.register_buffer("cos_sin_cache", compute_cos_sin_cache(config, rotary_dim), persistent=False)

    def _apply(self, fn, recurse=True):
        # `model.to(bfloat16)` casts every float buffer; the cache must stay float32.
        super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            if self.cos_sin_cache.is_meta:
                self.cos_sin_cache = self.cos_sin_cache.float()
            else:
                self.rebuild_cache()
        return self

    def rebuild_cache(self) -> None:
        """Recompute the cache on the current device (after building on "meta" and materialising)."""
        device = self.cos_sin_cache.device
        self.cos_sin_cache = compute_cos_sin_cache(self.config, self.rotary_dim).to(device)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, Hq, D] and key [T, Hkv, D] by their positions [T]."""
        return self.ops.rotary_embedding(positions, query, key, self.cos_sin_cache, True)


@dataclass(frozen=True)
class AttentionOptions:
    """What differs between the family's attention blocks."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    sliding_window: int | None = None
    #: the softmax scale of q.k; None: head_dim ** -0.5 (Gemma 3 uses query_pre_attn_scalar ** -0.5)
    scale: float | None = None


class Attention(nn.Module):
    """Fused-QKV self-attention over the paged KV cache; under tensor parallelism, this rank's heads only."""

    def __init__(
        self,
        config: ModelConfig,
        ops: KernelOps,
        rotary: RotaryEmbedding,
        options: AttentionOptions,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        heads = config_head_shard(config, tp.world_size, tp.rank)
        self.num_heads = heads.num_q_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5 if options.scale is None else options.scale
        self.sliding_window = options.sliding_window
        self.ops = ops
        self.qkv_proj = qkv_projection(config, options.qkv_bias, tp)
        self.o_proj = o_projection(config, options.o_bias, tp)
        self.rotary = rotary
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if options.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if options.qk_norm else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; writes this step's K/V into kv_cache first."""
        q = self.before_attention(positions, hidden, kv_cache, meta)
        return self.after_attention(self.attend(q, kv_cache, meta))

    def before_attention(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Everything before the attention kernel: hidden [T, hidden] -> q [T, Hq, D], after the QKV projection,
        the optional q/k norm, RoPE and the write of this step's K/V (only `meta.slot_mapping` is read)."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = self.rotary(positions, q, k)
        self.ops.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        return q

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention kernel over the paged cache: q [T, Hq, D] -> [T, Hq, D]."""
        return self.ops.paged_attention(q, kv_cache, meta, self.scale, self.sliding_window)

    def after_attention(self, attn_out: torch.Tensor) -> torch.Tensor:
        """The output projection: attention output [T, Hq, D] -> [T, hidden]."""
        return self.o_proj(attn_out.reshape(attn_out.shape[0], self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection."""

    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = gate_up_projection(config, tp)
        self.down_proj = down_projection(config, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class PreNormBlock(nn.Module):
    """Pre-norm transformer block; carries the residual stream apart so norms can fuse the add.

    Subclasses set `input_layernorm`, `self_attn(positions, hidden, cache, meta)`, `post_attention_layernorm`
    and `mlp`. `before_attention` / `after_attention` split the block at the attention kernel (for piecewise
    CUDA graphs, `deepinfer.engine.piecewise_graphs`); they need a `self_attn` with those halves (`Attention`).
    """

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (this block's output, residual stream before it); their sum is the true hidden state."""
        hidden, residual = self._input_norm(hidden, residual)
        return self._feed_forward(self.self_attn(positions, hidden, kv_cache, meta), residual)

    def before_attention(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block up to the attention kernel: (q [T, Hq, D], residual stream); writes this step's K/V."""
        hidden, residual = self._input_norm(hidden, residual)
        return self.self_attn.before_attention(positions, hidden, kv_cache, meta), residual

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block after the attention kernel: (this block's output, residual stream), as `forward` returns."""
        return self._feed_forward(self.self_attn.after_attention(attn_out), residual)

    def _input_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    def _feed_forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderLayer(PreNormBlock):
    """The Llama-family block: GQA attention over the paged KV cache and a gated MLP."""

    def __init__(
        self,
        config: ModelConfig,
        ops: KernelOps,
        rotary: RotaryEmbedding,
        options: AttentionOptions,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, ops, rotary, options, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, ops, tp)


class DecoderStack(nn.Module):
    """Embeddings, the decoder blocks and the final norm (HF's `model.` prefix); subclasses build the three."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        hidden = self.embed(input_ids)
        residual = None
        metas = meta.layer_metas or [meta] * len(kv_caches)  # KV groups: each layer reads its group's tables
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, metas, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, layer_meta)
        return self.final_norm(hidden, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first block's input [T, hidden]."""
        return self.embed_tokens(input_ids)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last block's (output, residual stream) -> final hidden states [T, hidden]."""
        if residual is None:
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden
