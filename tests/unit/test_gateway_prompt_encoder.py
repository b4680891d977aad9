"""The gateway's piecewise chat encoder gives the tokenizer's own ids, and stands aside where it could not."""

from __future__ import annotations

import json

import pytest

from deepinfer.tokenizer import Tokenizer
from services.gateway import prompt_encoder
from services.gateway.prompt_encoder import SegmentEncoder
from services.gateway.recipe import ModelInfo

TEXTS = [
    "Hello, world!",
    "  two leading spaces and\ttabs\n\nnew lines  ",
    "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
    "<|im_start|><|im_end|>  <|im_start|> 12345 <|im_end|>\n\n",
    "émigré 😀 👩‍💻 中文<|im_end|>日本語 <|endoftext|>x",
    "no added tokens at all, digits 2024 and   spaces",
    "<|im_start",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Tell me 3 things about the ocean, part 7."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And Japan? 🗾 <|im_end|> inside"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(prepared_dir):
    return Tokenizer.from_dir(prepared_dir)


def _texts(tokenizer: Tokenizer) -> list[str]:
    chats = [tokenizer.apply_chat_template(c, add_generation_prompt=g) for c in CONVERSATIONS for g in (True, False)]
    return TEXTS + chats


def test_ids_equal_the_tokenizers_when_pieces_are_new_and_when_cached(tokenizer):
    encoder = SegmentEncoder.for_tokenizer(tokenizer)
    assert encoder is not None  # the default model's added tokens split cleanly
    for text in _texts(tokenizer):
        expected = tokenizer.encode(text, add_special_tokens=False)
        assert encoder.encode(text) == expected, text
        assert encoder.encode(text) == expected, text  # every piece from the cache now
    cached = encoder.encode(_texts(tokenizer)[-1])
    cached.append(-1)  # a caller changing its ids changes no cached piece
    assert encoder.encode(_texts(tokenizer)[-1]) == tokenizer.encode(_texts(tokenizer)[-1], add_special_tokens=False)


def test_model_info_encodes_chats_with_it_and_without_it(prepared_dir):
    model = ModelInfo.from_dir(prepared_dir, "m")
    assert model.chat_encoder is not None
    for text in _texts(model.tokenizer):
        assert model.encode_chat_text(text) == model.tokenizer.encode(text, add_special_tokens=False)
    object.__setattr__(model, "chat_encoder", None)  # what a tokenizer that does not split cleanly gets
    text = _texts(model.tokenizer)[-1]
    assert model.encode_chat_text(text) == model.tokenizer.encode(text, add_special_tokens=False)


def test_cache_is_bounded(tokenizer, monkeypatch):
    monkeypatch.setattr(prompt_encoder, "MAX_PIECES", 4)
    monkeypatch.setattr(prompt_encoder, "MAX_PIECE_CHARS", 40)
    encoder = SegmentEncoder.for_tokenizer(tokenizer)
    assert encoder is not None
    for i in range(10):
        text = f"<|im_start|>user\nmessage {i}<|im_end|>\n"
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)
        assert len(encoder._pieces) <= 4
    long_text = "<|im_start|>" + "long " * 20
    assert encoder.encode(long_text) == tokenizer.encode(long_text, add_special_tokens=False)
    assert "long " * 20 not in encoder._pieces


def _with_tokenizer_json(prepared_dir, tmp_path, change):
    """A copy of the model's tokenizer with its tokenizer.json changed by `change(dict)`."""
    for name in ("tokenizer_config.json", "generation_config.json"):
        if (prepared_dir / name).is_file():
            (tmp_path / name).symlink_to(prepared_dir / name)
    data = json.loads((prepared_dir / "tokenizer.json").read_text())
    change(data)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    return Tokenizer.from_dir(tmp_path)


def test_stands_aside_for_added_tokens_that_strip_spaces(prepared_dir, tmp_path):
    def lstrip_all(data):
        for token in data["added_tokens"]:
            token["lstrip"] = True

    tokenizer = _with_tokenizer_json(prepared_dir, tmp_path, lstrip_all)
    text = "hello <|im_end|> world"
    # the pieces' ids would differ here: the token takes the space before it
    assert tokenizer.encode(text, add_special_tokens=False) != (
        tokenizer.encode("hello ", add_special_tokens=False) + [tokenizer.token_to_id("<|im_end|>")]
        + tokenizer.encode(" world", add_special_tokens=False)
    )
    assert SegmentEncoder.for_tokenizer(tokenizer) is None


def test_stands_aside_for_a_normalizer(prepared_dir, tmp_path):
    def lowercase(data):
        data["normalizer"] = {"type": "Lowercase"}

    assert SegmentEncoder.for_tokenizer(_with_tokenizer_json(prepared_dir, tmp_path, lowercase)) is None


def test_stands_aside_for_added_tokens_matched_in_two_passes(prepared_dir, tmp_path):
    def one_normalized(data):
        data["added_tokens"][-1]["normalized"] = True

    assert SegmentEncoder.for_tokenizer(_with_tokenizer_json(prepared_dir, tmp_path, one_normalized)) is None
