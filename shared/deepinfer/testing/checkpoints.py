"""Tiny random-weight Hugging Face checkpoints (built with transformers) for parity and end-to-end tests.

Weights are drawn with a wide spread so greedy decoding has clear winners: with std 0.4 the gap between
the top two logits is rarely below 1e-2, far above float32 kernel differences (~1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

#: Special tokens take ids 0..3 in the tiny tokenizer.
SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN_ID, PAD_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 3

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Llama 3.1-style scaling squeezed into a 512-token model, so both scaled and unscaled bands exist.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

_TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks, "
    "and a prefix cache lets many requests share the blocks of a common system prompt. Continuous "
    "batching schedules prefill and decode tokens of many sequences in the same step. Hello, world! "
    "How are you today? I am fine, thank you. What is the capital of France? Paris is the capital. "
    "One, two, three, four, five, six, seven, eight, nine, ten. 0123456789 {}[]()<>+-*/=_\"'?!.,;:\n"
)

_BASE = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
}

# Per architecture: distinct shapes where the real models differ (Qwen3's head_dim != hidden/heads,
# small Qwen2 ties its embeddings).
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_hidden_layers": 3},
    "mistral": {"sliding_window": None},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 32},
    # Five local layers then a global one, a window far shorter than the test prompts, each type its own RoPE base
    # and a query_pre_attn_scalar that is not head_dim (so a wrong scale shows).
    "gemma3": {
        "num_hidden_layers": 6,
        "sliding_window": 8,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        "query_pre_attn_scalar": 24,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
    },
}


def _config(arch: str, overrides: dict[str, Any]) -> Any:
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma3": transformers.Gemma3TextConfig,
    }
    if arch not in classes:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {TINY_ARCHS}")
    kwargs = {**_BASE, **_ARCH_DEFAULTS[arch], **overrides}
    if arch == "gemma3":
        kwargs.pop("rope_theta")  # Gemma 3 names one base per layer type, in rope_parameters
    config = classes[arch](**kwargs)
    if arch == "gemma3":
        config.architectures = ["Gemma3ForCausalLM"]  # AutoModelForCausalLM's class for gemma3_text
    return config


def _randomise(model: Any, std: float, zero_centred_norms: bool = False) -> None:
    """Wide random weights (norm gains around 1, small biases) so logits have clear winners."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                # a gain around 1; Gemma stores gains zero-centred (the norm multiplies by 1 + weight)
                param.uniform_(-0.5, 0.5) if zero_centred_norms else param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, std)


def make_tiny_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` (ids < vocab_size) trained on a short built-in text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_TRAINING_TEXT], trainer)
    assert tokenizer.get_vocab_size() <= vocab_size
    return tokenizer


def _write_tokenizer(path: Path, vocab_size: int, max_length: int) -> None:
    make_tiny_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "pad_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        "add_bos_token": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")


#: The context length `write_tokenizer_dir` writes by default.
TOKENIZER_DIR_MAX_MODEL_LEN = 96


def write_tokenizer_dir(path: Path, max_model_len: int = TOKENIZER_DIR_MAX_MODEL_LEN) -> Path:
    """A model directory without weights: config.json (the context length), the tiny tokenizer and its config."""
    path.mkdir(parents=True, exist_ok=True)
    make_tiny_tokenizer(384).save(str(path / "tokenizer.json"))
    config = {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[3], "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": max_model_len}))
    return path


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    std: float = 0.4,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> Path:
    """Save a tiny random `<arch>` model (safetensors, config, tokenizer) into `path` and return it.

    `overrides` go to the transformers config (e.g. `rope_scaling=LLAMA3_ROPE_SCALING`,
    `tie_word_embeddings=True`); `max_shard_size` (e.g. "100KB") writes a sharded checkpoint with an index.
    """
    import torch
    import transformers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomise(model, std, zero_centred_norms=arch == "gemma3")
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    _write_tokenizer(out, config.vocab_size, config.max_position_embeddings)
    return out
