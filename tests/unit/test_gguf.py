"""GGUF conversion checked against transformers' own GGUF loader and tokenizer (code we did not write)."""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_model_store import SPM_PIECES, llama_cpp_permute, write_tiny_gguf

from deepinfer.loader.gguf import convert_gguf_to_hf, unpermute_rotary
from deepinfer.model_store import default_gguf_path, resolve_model
from deepinfer.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "  leading spaces\n\n\ttabs and trailing   ",
    "café naïve façade — “quotes” «guillemets»",
    "emoji 😀👍🏽👩‍👩‍👧 flags 🇫🇷",
    "中文字符 日本語のテキスト 한국어",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i]; }",
    "3.14159 12345 1,000,000",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? 🇮🇹"},
]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gguf_path():
    return default_gguf_path()


@pytest.fixture(scope="module")
def transformers_gguf_model(gguf_path):
    """transformers' GGUF path: its config parser, and its dequantize + q/k un-permute of every tensor."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # from_pretrained(gguf_file=...) also wants `accelerate`; this is the loader it calls underneath.
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    return config, tensors


@pytest.fixture(scope="module")
def transformers_gguf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def test_weights_match_transformers_gguf_loader(prepared_dir, transformers_gguf_model):
    _, reference = transformers_gguf_model
    ours = load_file(str(prepared_dir / "model.safetensors"))
    assert set(ours) == set(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == np.float32
        assert ours[name].shape == tuple(tensor.shape), name
        np.testing.assert_allclose(ours[name], tensor.float().numpy(), rtol=0, atol=1e-6, err_msg=name)


def test_config_matches_transformers_gguf_config(prepared_dir, transformers_gguf_model):
    reference, _ = transformers_gguf_model
    ours = json.loads((prepared_dir / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "head_dim"):
        assert ours[key] == getattr(reference, key), key
    assert ours["rms_norm_eps"] == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert ours["rope_theta"] == reference.rope_parameters["rope_theta"]
    generation = json.loads((prepared_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1


@pytest.mark.parametrize(("num_heads", "rows", "cols"), [(9, 576, 8), (3, 192, 5), (2, 16, 3)])
def test_unpermute_inverts_llama_cpp_permutation(num_heads, rows, cols):
    weight = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rotary(permuted, num_heads), weight)


def test_tokenizer_matches_transformers_gguf_tokenizer(prepared_dir, transformers_gguf_tokenizer):
    reference = transformers_gguf_tokenizer
    ours = Tokenizer.from_dir(prepared_dir)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    for add_generation_prompt in (True, False):
        text = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
        assert text == reference.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours.encode_chat(MESSAGES, add_generation_prompt=add_generation_prompt) == (
            reference.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, return_dict=False)
        )
    assert ours.bos_token_id == reference.bos_token_id and ours.eos_token_id == reference.eos_token_id


def test_numerals_are_split_one_per_pretoken_like_the_original_smollm(prepared_dir):
    # SmolLM2's own tokenizer.json (Digits(individual_digits) + ByteLevel) and llama.cpp's "smollm" regex
    # (\p{N} first) never let a token cross a numeral. transformers' GGUF tokenizer lacks that rule and
    # gives " ½" → "ĠÂ" + "½"; we follow the model's own tokenizer.
    ours = Tokenizer.from_dir(prepared_dir)
    for text in [" ½", " ١٢٣", "x 12 ³", " ²³", "Ⅷ 7"]:
        ids = ours.encode(text)
        assert ours.decode(ids) == text
        raw_tokens = [ours.backend.id_to_token(i) for i in ids]
        pieces = [bytes(_BYTE_DECODER[c] for c in token).decode("utf-8", "replace") for token in raw_tokens]
        for piece in pieces:
            numerals = [c for c in piece if unicodedata.category(c).startswith("N")]
            assert not numerals or piece == numerals[0], (text, pieces)


def _byte_decoder() -> dict[str, int]:
    # GPT-2's printable-character → byte table, inverted.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


_BYTE_DECODER = _byte_decoder()


def test_prepared_dir_answers_paris_with_plain_transformers(prepared_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepared_dir)
    model = AutoModelForCausalLM.from_pretrained(prepared_dir)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_dict=False
    )
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, len(prompt_ids):], skip_special_tokens=True)
    assert "Paris" in answer


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        convert_gguf_to_hf(path, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="'mamba'"):
        resolve_model(path, tmp_path / "cache", progress=False)
    assert not any((tmp_path / "cache").glob("*/config.json"))


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, tokenizer_model="llama")
    ours = Tokenizer.from_dir(convert_gguf_to_hf(path, tmp_path / "out", progress=False))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert {piece for piece, _ in SPM_PIECES} <= set(reference.get_vocab())
    for text in ["a", "ab abc", " ab", "cab ba", "é", "a\nb", "<s>ab</s>"]:
        for add_special_tokens in (True, False):
            expected = reference.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text
            assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=True)
