"""Multi-head latent attention (DeepSeek V2/V3) over the paged latent cache.

Per token the cache keeps c_kv = RMSNorm(W_DKV x) [kv_lora_rank] and the rotated shared key k_pe [rope_dim].
kv_b_proj maps c_kv to per-head (k_nope, v): its weight [H * (nope + v), C] splits into W_UK [H, nope, C] and
W_UV [H, v, C].

    prefill rows (q_len > 1): naive — expand each sequence's cached latents to K/V per head, varlen attention
    decode rows (q_len = 1):  absorbed — q_lat = q_nope · W_UK, attend [q_lat ‖ q_pe] over cache rows, o · W_UVᵀ
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from deepinfer.kernels import AttentionMetadata, KernelOps, torch_mla
from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import RMSNorm, RotaryEmbedding


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(config: ModelConfig) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as DeepSeek and transformers)."""
    assert config.mla is not None
    scale = config.mla.qk_head_dim**-0.5
    scaling = config.rope_scaling or {}
    if config.rope_type != "default" and scaling.get("mscale_all_dim"):
        mscale = _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def _op(ops: KernelOps, name: str, twin: Any) -> Any:
    """The accelerated op once KernelOps carries it, else the torch twin."""
    return getattr(ops, name, None) or twin


class MlaAttention(nn.Module):
    """MLA with optional q-LoRA; HF parameter names (q_proj | q_a_proj/q_a_layernorm/q_b_proj, kv_a_..., o_proj)."""

    def __init__(self, config: ModelConfig, ops: KernelOps, rotary: RotaryEmbedding) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None, "MlaAttention needs config.mla"
        self.num_heads = config.num_attention_heads
        self.kv_lora_rank = mla.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.qk_head_dim = mla.qk_head_dim
        self.scale = mla_softmax_scale(config)
        self.is_neox = not mla.rope_interleave
        self.ops = ops
        self.rotary = rotary
        self.cache_write = _op(ops, "mla_cache_write", torch_mla.mla_cache_write)
        self.paged_attention = _op(ops, "mla_paged_attention", torch_mla.mla_paged_attention)
        self.gather_latent = _op(ops, "mla_gather_latent", torch_mla.gather_latent)
        self.varlen_attention = _op(ops, "varlen_causal_attention", torch_mla.varlen_causal_attention)
        hidden, bias = config.hidden_size, config.attention_bias
        q_out = self.num_heads * self.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6, ops)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6, ops)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return q.view(hidden.shape[0], self.num_heads, self.qk_head_dim)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; writes this step's latent rows into latent_cache first."""
        num_tokens = hidden.shape[0]
        q_nope, q_pe = self._query(hidden).split([self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self.ops.rotary_embedding(
            positions, q_pe.contiguous(), k_pe.reshape(num_tokens, 1, self.rope_dim), self.rotary.cos_sin_cache,
            self.is_neox,
        )
        self.cache_write(kv_c, k_pe.reshape(num_tokens, self.rope_dim), latent_cache, meta.slot_mapping)
        out = hidden.new_zeros(num_tokens, self.num_heads, self.v_dim)
        starts = meta.query_start_loc_cpu
        q_lens = [starts[b + 1] - starts[b] for b in range(meta.num_seqs)]
        decode = [b for b, n in enumerate(q_lens) if n == 1]
        prefill = [b for b, n in enumerate(q_lens) if n > 1]
        for seqs, run in ((decode, self._absorbed), (prefill, self._naive)):
            if not seqs:
                continue
            if len(seqs) == meta.num_seqs:
                rows = slice(0, starts[-1])
                out[rows] = run(q_nope[rows], q_pe[rows], latent_cache, meta)
            else:
                sub, rows = torch_mla.select_sequences(meta, seqs)
                out[rows] = run(q_nope[rows], q_pe[rows], latent_cache, sub)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))

    def _kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, C], W_UV [H, v, C]) views of kv_b_proj.weight."""
        weight = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return weight[:, : self.nope_dim], weight[:, self.nope_dim :]

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Weight-absorbed attention over the latent rows: [T, H, nope/rope] -> [T, H, v]."""
        w_uk, w_uv = self._kv_b_weights()
        q_latent = torch.einsum("thd,hdc->thc", q_nope, w_uk)
        out_latent = self.paged_attention(
            torch.cat((q_latent, q_pe), dim=-1), latent_cache, meta, self.scale, self.kv_lora_rank
        )
        return torch.einsum("thc,hvc->thv", out_latent, w_uv)

    def _naive(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Expand every context latent to per-head K/V, then causal varlen attention: -> [T, H, v]."""
        latent, cu_seqlens_k = self.gather_latent(latent_cache, meta)
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(kv_c).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, value = kv.split([self.nope_dim, self.v_dim], dim=-1)
        key = torch.cat((k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        return self.varlen_attention(query, key, value, meta.query_start_loc_cpu, cu_seqlens_k, self.scale)
