"""DeepSeek V2 / V3: MLA over a paged latent cache, MoE with shared experts, and the MTP module.

V2 and V3 share every class; they differ in routing (`deepseek_moe.routing_strategy`) and RoPE layout
(`MlaConfig.rope_interleave`), both read from the config.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from deepinfer.kernels import AttentionMetadata, KernelOps
from deepinfer.models.config import ModelConfig
from deepinfer.models.deepseek_moe import DeepseekMoE, GatedMLP, Router
from deepinfer.models.deepseek_weights import load_deepseek_weights
from deepinfer.models.layers import DecoderStack, PreNormBlock, RMSNorm, RotaryEmbedding
from deepinfer.models.mla import MlaAttention
from deepinfer.models.parallel import uninitialized_embedding

logger = logging.getLogger(__name__)


class DeepseekDecoderLayer(PreNormBlock):
    """Pre-norm block: MLA, then a dense MLP (first_k_dense_replace layers) or the MoE."""

    def __init__(self, config: ModelConfig, ops: KernelOps, rotary: RotaryEmbedding, use_moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = MlaAttention(config, ops, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        if use_moe:
            assert config.moe is not None
            self.mlp: nn.Module = DeepseekMoE(config.hidden_size, config.moe, ops)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, ops)


class MtpLayer(DeepseekDecoderLayer):
    """One multi-token-prediction depth: [enorm(emb(t+1)) ‖ hnorm(h_t)] -> eh_proj -> block -> shared_head.norm."""

    def __init__(self, config: ModelConfig, ops: KernelOps, rotary: RotaryEmbedding) -> None:
        super().__init__(config, ops, rotary, use_moe=config.moe is not None)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class DeepseekModel(DecoderStack):
    """Embeddings, the decoder stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, ops: KernelOps, rotary: RotaryEmbedding) -> None:
        super().__init__()
        first_moe = config.moe.first_k_dense_replace if config.moe is not None else config.num_hidden_layers
        self.embed_tokens = uninitialized_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, ops, rotary, use_moe=i >= first_moe) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class DeepseekForCausalLM(nn.Module):
    """DeepSeek decoder over the paged latent cache (one [num_blocks, block_size, latent_dim] tensor per layer)."""

    def __init__(self, config: ModelConfig, ops: KernelOps) -> None:
        super().__init__()
        if config.mla is None:
            raise ValueError(f"{config.architecture} needs kv_lora_rank/qk_*_head_dim in config.json (MLA)")
        self.config = config
        self.ops = ops
        self.rotary = RotaryEmbedding(config, config.mla.qk_rope_head_dim, ops)  # shared by all layers
        self.model = DeepseekModel(config, ops, self.rotary)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp_layers = nn.ModuleList(MtpLayer(config, ops, self.rotary) for _ in range(config.num_nextn_predict_layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions [T] int64 -> hidden states [T, hidden]; writes this step's latents into kv_caches."""
        assert input_ids.dim() == 1 and input_ids.shape == positions.shape, (
            f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both be [T]"
        )
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(hidden, weight).float()

    @property
    def num_mtp_layers(self) -> int:
        """MTP depths loaded from the checkpoint (0 when it has none)."""
        return len(self.mtp_layers)

    def mtp_forward(
        self,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        depth: int = 0,
    ) -> torch.Tensor:
        """Logits [T, vocab] of token t+2 from the main model's final hidden states [T, hidden] at tokens t and
        the ids [T] of tokens t+1.

        `positions`/`meta` are the main step's (those of t): the MTP block keeps its latents in its own
        `kv_cache` (a main layer's shape) under the same block tables and slots. RoPE sees only position
        differences, so this equals running the pair at t+1's positions (as transformers' MtpModel does).
        """
        return self.compute_logits(self.mtp_hidden(hidden_states, next_token_ids, positions, kv_cache, meta, depth))

    def mtp_hidden(
        self,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        depth: int = 0,
    ) -> torch.Tensor:
        """`mtp_forward` up to its head: the MTP layer's normed output [T, hidden], whose logits (compute_logits)
        predict token t+2; every row's latents are written to `kv_cache` (a drafter takes the logits of a few)."""
        if depth >= len(self.mtp_layers):
            raise ValueError(f"MTP depth {depth} requested but the checkpoint has {len(self.mtp_layers)} MTP layer(s)")
        layer: MtpLayer = self.mtp_layers[depth]
        embeds = layer.enorm(self.model.embed_tokens(next_token_ids))
        hidden = layer.eh_proj(torch.cat((embeds, layer.hnorm(hidden_states)), dim=-1))
        hidden, residual = layer(positions, hidden, None, kv_cache, meta)
        return layer.shared_head.norm(hidden + residual)

    def ignores_weight(self, name: str) -> bool:
        """Checkpoint tensors that carry nothing we load (a tied model's lm_head copy)."""
        return self.lm_head is None and name == "lm_head.weight"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (per-expert or fused experts, optional MTP layers); ValueError on any mismatch."""
        routers = [m for m in self.modules() if isinstance(m, Router)]
        for router in routers:  # V2 checkpoints have no bias: it stays zero
            router.e_score_correction_bias.data.zero_()
        optional = {
            name for name, _ in self.named_parameters() if name.endswith("e_score_correction_bias")
        } if not any(r.has_bias for r in routers) else set()
        optional |= {name for name, _ in self.named_parameters() if name.startswith("mtp_layers.")}
        empty = load_deepseek_weights(
            self, (w for w in weights if not self.ignores_weight(w[0])), self.config.num_hidden_layers, optional
        )
        mtp_params = {name for name, _ in self.named_parameters() if name.startswith("mtp_layers.")}
        if mtp_params and mtp_params <= empty:
            logger.info("config has %d MTP layer(s) but the checkpoint none: MTP disabled", len(self.mtp_layers))
            self.mtp_layers = nn.ModuleList()
        elif mtp_params & empty:
            shown = ", ".join(sorted(mtp_params & empty)[:10])
            raise ValueError(f"checkpoint has only part of the MTP layers' tensors; missing: {shown}")

    def rebuild_buffers(self) -> None:
        """Recompute non-persistent buffers (the RoPE cache) after materialising from the "meta" device."""
        self.rotary.rebuild_cache()


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V2 / V2-Lite: softmax top-k routing, q-LoRA optional."""


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V3 / R1: sigmoid routing with correction bias over expert groups, MTP module."""
