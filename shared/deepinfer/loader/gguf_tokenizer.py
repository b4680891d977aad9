"""A GGUF's tokenizer as Hugging Face files: `tokenizer.json` rebuilt from the `tokenizer.ggml.*` metadata
(byte-level BPE for "gpt2" vocabularies, sentencepiece BPE for "llama" ones, Gemma's variant of it for gemma3
files) and `tokenizer_config.json`. Used by the GGUF converter (deepinfer.loader.gguf); transformers' GGUF
tokenizer (`integrations/gguf/gguf_tokenizer_mapping.py`) is the reference the tests compare with."""

from __future__ import annotations

from typing import Any

from deepinfer.loader.chat_templates import GEMMA3_CHAT_TEMPLATE

# llama.cpp's token types (gguf.TokenType): what the vocabulary says each entry is.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split regexes llama.cpp names by `tokenizer.ggml.pre` (the same ones transformers' GGUF loader uses).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _special_token(metadata: dict[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else metadata["tokenizer.ggml.tokens"][int(token_id)]


def _add_bos_token(metadata: dict[str, Any]) -> bool:
    # Older sentencepiece files carry no flag and llama.cpp adds BOS to them (transformers does the same).
    default = metadata.get("tokenizer.ggml.model") == "llama"
    return bool(metadata.get("tokenizer.ggml.add_bos_token", default))


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` rebuilt from the GGUF's `tokenizer.ggml.*` metadata."""
    model = metadata.get("tokenizer.ggml.model")
    gemma = model == "llama" and _is_gemma(metadata)
    if model == "gpt2":
        tokenizer = _byte_level_bpe(metadata)
    elif gemma:
        tokenizer = _gemma_bpe(metadata)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(metadata)
    else:
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2', 'llama')")
    _add_special_tokens(tokenizer, metadata, byte_level=model == "gpt2", known_user_defined_only=gemma)
    _set_post_processor(tokenizer, metadata)
    return tokenizer


def _byte_level_bpe(metadata: dict[str, Any]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    # A token written in plain UTF-8 (not in the byte alphabet) is re-spelled byte by byte, as transformers does.
    speller = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {
        token if set(token) <= alphabet else "".join(piece for piece, _ in speller.pre_tokenize_str(token)): index
        for index, token in enumerate(metadata["tokenizer.ggml.tokens"])
    }
    merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    pre = metadata.get("tokenizer.ggml.pre")
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if pre == "smollm":
        # SmolLM's own tokenizer.json (and llama.cpp's "smollm" regex): every digit on its own, then GPT-2's split.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(metadata: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(vocab, dict(zip(tokens, metadata["tokenizer.ggml.scores"], strict=True)))
    unk = _special_token(metadata, "unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _is_gemma(metadata: dict[str, Any]) -> bool:
    return metadata.get("general.architecture") in ("gemma", "gemma2", "gemma3")


def _gemma_bpe(metadata: dict[str, Any]) -> Any:
    """Gemma's sentencepiece BPE (transformers' GemmaTokenizer): spaces become "▁" in a normalizer, no prefix
    space, byte fallback. A GGUF spells its all-space tokens with real spaces ("  "): they are respelled "▁▁" so
    that merges built from them match. The file lists no merges and Gemma's scores do not follow the merge order;
    the vocabulary's order does, so merges are rebuilt ranked by it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in metadata["tokenizer.ggml.tokens"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _merges_from_scores(vocab, {token: -index for index, token in enumerate(tokens)})
    unk = _special_token(metadata, "unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    # A sentencepiece file lists no merges: every split of a token into two known pieces is one, best score first.
    merges = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, score) for left, right in pairs)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(
    tokenizer: Any, metadata: dict[str, Any], byte_level: bool, known_user_defined_only: bool = False
) -> None:
    # known_user_defined_only: add a user-defined token only if the vocabulary spells it as the file does (Gemma's
    # respelled all-space tokens are not added whole, as transformers does not).
    from tokenizers import AddedToken, pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    tokens, token_types = metadata["tokenizer.ggml.tokens"], metadata.get("tokenizer.ggml.token_type") or []
    # A control token outside the byte alphabet of a byte-level vocabulary is a llama.cpp mislabel: skip it.
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_TYPE_CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_TYPE_USER_DEFINED and (not known_user_defined_only or tokenizer.token_to_id(token) is not None)
    ]
    if control:
        tokenizer.add_special_tokens(control)
    if user_defined:
        tokenizer.add_tokens(user_defined)


def _set_post_processor(tokenizer: Any, metadata: dict[str, Any]) -> None:
    from tokenizers import processors

    bos = _special_token(metadata, "bos_token_id")
    eos = _special_token(metadata, "eos_token_id")
    add_bos = _add_bos_token(metadata) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        if metadata.get("tokenizer.ggml.model") == "gpt2":
            tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        return
    special = [(token, tokenizer.token_to_id(token)) for token, on in ((bos, add_bos), (eos, add_eos)) if on]
    prefix, suffix = (bos,) if add_bos else (), (eos,) if add_eos else ()

    def template(sequence: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (*prefix, sequence, *suffix)]

    tokenizer.post_processor = processors.TemplateProcessing(
        single=template("$A", 0), pair=template("$A", 0) + template("$B", 1), special_tokens=special
    )


def build_tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS/EOS flags and the chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _add_bos_token(metadata),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    arch = metadata.get("general.architecture")
    if f"{arch}.context_length" in metadata:
        config["model_max_length"] = int(metadata[f"{arch}.context_length"])
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token = _special_token(metadata, f"{key}_token_id")
        if token is not None:
            config[f"{name}_token"] = token
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    elif arch == "gemma3":
        # llama.cpp's GGUF-my-repo conversions of the base models carry none; Google's is the Gemma 3 format
        config["chat_template"] = GEMMA3_CHAT_TEMPLATE
    return config
