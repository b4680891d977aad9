"""GGUF → Hugging Face directory: float32 weights, config, tokenizer and chat template.

Every tensor is dequantized once with the `gguf` package, so a model served from the prepared
directory gives exactly the tokens the GGUF itself would give through the same engine.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.loader.gguf_tokenizer import build_tokenizer, build_tokenizer_config

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")

# GGUF per-layer tensor stem → HF parameter stem, under `model.layers.N.`.
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 (llama.cpp's names): QK-norm, and four norms a block, its `ffn_norm` being the pre-feedforward one.
_GEMMA3_LAYER_TENSOR_NAMES = {
    **_LAYER_TENSOR_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_TENSOR_NAMES_BY_ARCHITECTURE = {"llama": _LAYER_TENSOR_NAMES, "gemma3": _GEMMA3_LAYER_TENSOR_NAMES}
#: llama.cpp's Gemma 3 graph has no per-file settings for these: every sixth layer is global, the local layers'
#: RoPE base is 10000, and the query scale is head_dim ** -0.5 but for the 27B (62 layers): (hidden / heads) ** -0.5.
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_27B_BLOCK_COUNT = 62
_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# llama.cpp's `general.sampling.*` defaults → generation_config.json names.
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """Every key/value field of an open `gguf.GGUFReader`, as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def gguf_architecture(metadata: dict[str, Any]) -> str:
    """The file's `general.architecture`, or a ValueError naming it when we cannot convert it."""
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {architecture!r}: DeepInfer converts only "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUF files"
        )
    return architecture


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    """The HF parameter name for a GGUF tensor name (`blk.3.attn_q.weight` → `model.layers.3...`)."""
    layer_names = _LAYER_TENSOR_NAMES_BY_ARCHITECTURE[architecture]
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in layer_names:
            return f"model.layers.{int(layer)}.{layer_names[part]}.{suffix}"
    elif stem in _GLOBAL_TENSOR_NAMES:
        return f"{_GLOBAL_TENSOR_NAMES[stem]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face {architecture} equivalent; cannot convert "
                     "this file")


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs → HF's rotate-half halves).

    llama.cpp's converter does `w.reshape(H, 2, D/2, ...).swapaxes(1, 2)`; this is its exact inverse.
    weight: [num_heads * head_dim, hidden_size]
    """
    head_half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, head_half, 2, *weight.shape[1:])
    return np.ascontiguousarray(rows.swapaxes(1, 2).reshape(weight.shape))


def load_gguf_state_dict(gguf_path: str | Path, progress: bool = False) -> dict[str, np.ndarray]:
    """Dequantize every tensor of a GGUF to float32, under HF names, as transformers holds them (llama: q/k
    un-permuted; gemma3: norm weights zero-centred again)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    return _dequantize_tensors(reader, read_gguf_metadata(reader), progress)


def _dequantize_tensors(reader: Any, metadata: dict[str, Any], progress: bool) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize
    from tqdm import tqdm

    architecture = gguf_architecture(metadata)
    num_heads = int(metadata[f"{architecture}.attention.head_count"])
    num_kv_heads = int(metadata.get(f"{architecture}.attention.head_count_kv", num_heads))
    state_dict: dict[str, np.ndarray] = {}
    tensors = tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", disable=not progress, leave=False)
    for tensor in tensors:
        if tensor.name == "rope_freqs.weight":
            raise ValueError("GGUF with llama3-style rope scaling (a rope_freqs tensor) is not supported")
        name = hf_tensor_name(tensor.name, architecture)
        # numpy shape is the GGUF shape reversed, which is HF's [out_features, in_features]
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = weight.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if architecture == "gemma3":
            if name.endswith("norm.weight"):
                weight = weight - np.float32(1.0)  # llama.cpp stores Gemma's gains as 1 + weight
        elif name.endswith("q_proj.weight"):
            weight = unpermute_rotary(weight, num_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rotary(weight, num_kv_heads)
        state_dict[name] = np.ascontiguousarray(weight)
    return state_dict


def build_config(metadata: dict[str, Any], tie_word_embeddings: bool, vocab_size: int) -> dict[str, Any]:
    """A LlamaForCausalLM or Gemma3ForCausalLM config.json from the GGUF's `<architecture>.*` metadata."""
    arch = gguf_architecture(metadata)

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden_size // num_heads))
    rotary_dim = int(key("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary embeddings ({rotary_dim} of {head_dim} dims) are not supported")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": _shortest_float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _shortest_float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(key),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        config = _gemma3_config(config, key)
    for name in ("bos_token_id", "eos_token_id", "padding_token_id"):
        token_id = metadata.get(f"tokenizer.ggml.{name}")
        if token_id is not None:
            config[name.replace("padding", "pad")] = int(token_id)
    return config


def _gemma3_config(llama: dict[str, Any], key: Any) -> dict[str, Any]:
    """The Llama-shaped config turned into a Gemma 3 text one, with the settings llama.cpp hard-codes."""
    num_layers, head_dim = llama["num_hidden_layers"], llama["head_dim"]
    scalar = llama["hidden_size"] // llama["num_attention_heads"] if num_layers == _GEMMA3_27B_BLOCK_COUNT else head_dim
    pattern = _GEMMA3_SLIDING_WINDOW_PATTERN
    dropped = ("hidden_act", "mlp_bias")
    return {
        **{name: value for name, value in llama.items() if name not in dropped},
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)],
        "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_THETA,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _shortest_float(value: float) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.99999974e-06; write the shortest decimal that round-trips.
    return float(str(np.float32(value)))


def _rope_scaling(key: Any) -> dict[str, Any] | None:
    scaling_type = key("rope.scaling.type", "none")
    factor = key("rope.scaling.factor")
    if scaling_type in ("none", None) or not factor or float(factor) == 1.0:
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if scaling_type == "yarn":
        original = int(key("rope.scaling.original_context_length"))
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original}
    raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported")


def build_generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: BOS/EOS ids (EOT/EOM join EOS) and the file's sampling defaults, if any."""
    config: dict[str, Any] = {}
    if metadata.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(metadata["tokenizer.ggml.bos_token_id"])
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos_ids = list(dict.fromkeys(int(metadata[f"tokenizer.ggml.{k}"]) for k in eos_keys if f"tokenizer.ggml.{k}" in metadata))
    eos_ids += [i for i in end_of_turn_ids(metadata) if i not in eos_ids]
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if metadata.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = int(metadata["tokenizer.ggml.padding_token_id"])
    for key, name in _SAMPLING_KEYS.items():
        value = metadata.get(f"general.sampling.{key}")
        if value is not None:
            config[name] = int(value) if name == "top_k" else _shortest_float(value)
    if "temperature" in config:
        config["do_sample"] = config["temperature"] > 0
    return config


def end_of_turn_ids(metadata: dict[str, Any]) -> list[int]:
    """Gemma's `<end_of_turn>`, which ends a chat reply; llama.cpp counts it as end of generation though a GGUF
    names it nowhere (Google's own generation_config lists it beside `<eos>`)."""
    if metadata.get("general.architecture") != "gemma3":
        return []
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    return [i for i, token in enumerate(tokens) if token == "<end_of_turn>"][:1]


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write a Hugging Face directory (float32 safetensors, config, tokenizer) from a llama or gemma3 GGUF."""
    import gguf
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    metadata = read_gguf_metadata(reader)
    gguf_architecture(metadata)
    tokenizer = build_tokenizer(metadata)  # before the slow part: an unsupported vocabulary fails fast
    state_dict = _dequantize_tensors(reader, metadata, progress)
    del reader
    if "model.embed_tokens.weight" not in state_dict:
        raise ValueError(f"{gguf_path} has no token_embd tensor")
    vocab_size = int(state_dict["model.embed_tokens.weight"].shape[0])
    tie_word_embeddings = "lm_head.weight" not in state_dict

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(state_dict.items())), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state_dict
    tokenizer.save(str(out_dir / "tokenizer.json"))
    documents = {
        "config.json": build_config(metadata, tie_word_embeddings, vocab_size),
        "tokenizer_config.json": build_tokenizer_config(metadata),
        "generation_config.json": build_generation_config(metadata),
    }
    for file_name, document in documents.items():
        (out_dir / file_name).write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    logger.info("converted %s into %s", gguf_path.name, out_dir)
    return out_dir
