"""Tiny random-weight DeepSeek V2/V3 checkpoints (built with transformers), optionally with an MTP layer.

transformers builds no MTP weights, so they are drawn here and appended under DeepSeek-V3's names
(`model.layers.{num_hidden_layers}.{enorm,hnorm,eh_proj,shared_head.*,embed_tokens,self_attn.*,mlp.*,...}`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Shared with the Llama-family helper: tokenizer files and the wide weight spread.
from deepinfer.testing.checkpoints import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    _randomise,
    _write_tokenizer,
)

DEEPSEEK_ARCHS = ("deepseek_v2", "deepseek_v3")

#: DeepSeek-style YaRN squeezed into a 512-token model (mscale_all_dim also scales the softmax).
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

_BASE: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
}

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"topk_method": "greedy", "routed_scaling_factor": 1.0, "n_shared_experts": 2},
    "deepseek_v3": {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                    "num_nextn_predict_layers": 0},
}


def _config(arch: str, overrides: dict[str, Any]) -> Any:
    import transformers

    classes = {"deepseek_v2": transformers.DeepseekV2Config, "deepseek_v3": transformers.DeepseekV3Config}
    if arch not in classes:
        raise ValueError(f"unknown tiny DeepSeek architecture {arch!r}; expected one of {DEEPSEEK_ARCHS}")
    return classes[arch](**{**_BASE, **_ARCH_DEFAULTS[arch], **overrides})


def _randomise_router_bias(model: Any, std: float) -> None:
    """V3's e_score_correction_bias is a buffer transformers leaves at zero: give it a spread that matters."""
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, std)


def _hf_layer_tensors(model: Any, layer: int, prefix: str) -> dict[str, Any]:
    """One decoder layer's tensors under checkpoint names (experts split per expert, as real checkpoints)."""
    tensors: dict[str, Any] = {}
    block = model.model.layers[layer]
    for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
        if name.endswith("experts.gate_up_proj"):
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                tensors[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = gate
                tensors[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            for e, down in enumerate(tensor):
                tensors[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = down
        else:
            tensors[f"{prefix}.{name}"] = tensor
    return tensors


def _mtp_tensors(config: Any, main: Any, seed: int, std: float) -> dict[str, Any]:
    """MTP layer(s) under DeepSeek-V3 checkpoint names; embed/head entries copy the main model's."""
    import torch
    import transformers

    num_layers, hidden = config.num_hidden_layers, config.hidden_size
    tensors: dict[str, Any] = {}
    for k in range(config.num_nextn_predict_layers):
        extra = type(config)(**{**config.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0,
                                "num_nextn_predict_layers": 0})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1000 + k)
            block = transformers.AutoModelForCausalLM.from_config(extra, dtype=torch.float32)
            _randomise(block, std)
            _randomise_router_bias(block, 0.1)
            prefix = f"model.layers.{num_layers + k}"
            tensors.update(_hf_layer_tensors(block, 0, prefix))
            tensors[f"{prefix}.enorm.weight"] = torch.empty(hidden).uniform_(0.5, 1.5)
            tensors[f"{prefix}.hnorm.weight"] = torch.empty(hidden).uniform_(0.5, 1.5)
            tensors[f"{prefix}.eh_proj.weight"] = torch.empty(hidden, 2 * hidden).normal_(0.0, std)
            tensors[f"{prefix}.shared_head.norm.weight"] = torch.empty(hidden).uniform_(0.5, 1.5)
        tensors[f"{prefix}.embed_tokens.weight"] = main.model.embed_tokens.weight.detach()
        tensors[f"{prefix}.shared_head.head.weight"] = main.lm_head.weight.detach()
    return {name: t.detach().clone().contiguous() for name, t in tensors.items()}


def make_tiny_deepseek_checkpoint(
    path: str | Path,
    arch: str = "deepseek_v3",
    *,
    seed: int = 0,
    std: float = 0.4,
    bias_std: float = 0.1,
    **overrides: Any,
) -> Path:
    """Save a tiny random DeepSeek model (safetensors, config, tokenizer) into `path` and return it.

    `overrides` go to the transformers config (e.g. `q_lora_rank=None`, `topk_method="group_limited_greedy"`,
    `rope_parameters=DEEPSEEK_YARN`, `num_nextn_predict_layers=1` to append an MTP layer).
    """
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomise(model, std)
        _randomise_router_bias(model, bias_std)
    model.save_pretrained(out, safe_serialization=True)
    if getattr(config, "num_nextn_predict_layers", 0):
        weights_file = out / "model.safetensors"
        tensors = load_file(str(weights_file))
        tensors.update(_mtp_tensors(config, model, seed, std))
        save_file(tensors, str(weights_file), metadata={"format": "pt"})
    _write_tokenizer(out, config.vocab_size, config.max_position_embeddings)
    return out
