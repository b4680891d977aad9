"""Random-weight checkpoints of named shapes with the default model's tokenizer: a serving bench that needs no
download. Only config.json and the tokenizer files are written (once, into a cache dir); workers and the offline
engine draw the weights themselves (`load_format=dummy`, the same seed everywhere, so all hold one model).

    python -m deepinfer.testing.random_model llama-1b [--cache-dir .bench-models]     # prints the directory
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

#: Shapes by name: Llama 3.2 1B and Llama 3.1 8B, and Gemma 3 1B (GEMMA3_SHAPES), with the default model's
#: 49,152-token vocabulary. Their context is Llama 3.1's 128k (Gemma 3 1B's 32k; workers still cap max_model_len at
#: 8192 unless told: DEEPINFER_*_MAX_MODEL_LEN).
SHAPES: dict[str, dict] = {
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True},
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
}
#: Gemma 3 text shapes (Gemma3ForCausalLM: five sliding-window layers of 512 keys to one global, GeGLU, QK-norm).
GEMMA3_SHAPES: dict[str, dict] = {
    "gemma3-1b": {"hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
                  "num_key_value_heads": 1, "head_dim": 256, "tie_word_embeddings": True},
}
SHAPES.update(GEMMA3_SHAPES)
MAX_POSITION_EMBEDDINGS = 131072
GEMMA3_MAX_POSITION_EMBEDDINGS = 32768
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
DEFAULT_CACHE_DIR = Path(".bench-models")


def write_random_model(shape: str, cache_dir: Path = DEFAULT_CACHE_DIR, tokenizer_dir: Path | None = None) -> Path:
    """`cache_dir/<shape>/` with config.json (the shape) and the tokenizer files; reused when already there with
    this shape (an older config.json, e.g. of an 8k context, is written again)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    target = Path(cache_dir) / shape
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        config = json.loads((target / "config.json").read_text())
        max_positions = GEMMA3_MAX_POSITION_EMBEDDINGS if shape in GEMMA3_SHAPES else MAX_POSITION_EMBEDDINGS
        if config.get("max_position_embeddings") == max_positions and config.items() >= SHAPES[shape].items():
            return target.resolve()
    source = tokenizer_dir or _default_model_dir()
    base = json.loads((source / "config.json").read_text())
    config = _gemma3_config(shape) if shape in GEMMA3_SHAPES else {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, **SHAPES[shape],
    }
    config |= {"vocab_size": base["vocab_size"], "torch_dtype": "bfloat16", "bos_token_id": base.get("bos_token_id"),
               "eos_token_id": base.get("eos_token_id")}
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target.resolve()


def _gemma3_config(shape: str) -> dict:
    """Gemma 3's config.json fields for a shape: every sixth layer global, the rest a 512-key window."""
    num_layers = SHAPES[shape]["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "max_position_embeddings": GEMMA3_MAX_POSITION_EMBEDDINGS,
            "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rope_scaling": None,
            "sliding_window": 512, "layer_types": layer_types, "query_pre_attn_scalar": SHAPES[shape]["head_dim"],
            "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, **SHAPES[shape]}


def num_parameters(shape: str, vocab_size: int = 49152) -> int:
    """Parameters of a shape (embedding counted once when tied)."""
    s = SHAPES[shape]
    hidden, heads, kv_heads, head_dim = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    layer = attention + 3 * hidden * s["intermediate_size"] + 2 * hidden
    embeddings = vocab_size * hidden * (1 if s["tie_word_embeddings"] else 2)
    return s["num_hidden_layers"] * layer + embeddings + hidden


def _default_model_dir() -> Path:
    from deepinfer.config import CommonSettings
    from deepinfer.model_store import resolve_model

    return resolve_model(None, CommonSettings().model_cache_dir, progress=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args()
    print(write_random_model(args.shape, args.cache_dir))
