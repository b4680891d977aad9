"""deepinfer.testing.random_model: a random-weight checkpoint dir of a named shape, rewritten when an older one is there."""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.testing.random_model import MAX_POSITION_EMBEDDINGS, SHAPES, write_random_model


def tokenizer_dir(tmp_path: Path) -> Path:
    source = tmp_path / "base"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"vocab_size": 1000, "bos_token_id": 1, "eos_token_id": 2}))
    (source / "tokenizer.json").write_text("{}")
    return source


def test_the_shape_gets_a_128k_context_and_the_base_vocabulary(tmp_path: Path) -> None:
    target = write_random_model("llama-8b", tmp_path / "cache", tokenizer_dir(tmp_path))
    config = json.loads((target / "config.json").read_text())
    assert config["max_position_embeddings"] == MAX_POSITION_EMBEDDINGS >= 32768 + 1024
    assert config["vocab_size"] == 1000 and config.items() >= SHAPES["llama-8b"].items()
    assert (target / "tokenizer.json").is_file()


def test_an_older_config_is_written_again(tmp_path: Path) -> None:
    source = tokenizer_dir(tmp_path)
    target = write_random_model("llama-1b", tmp_path / "cache", source)
    stale = json.loads((target / "config.json").read_text()) | {"max_position_embeddings": 8192}
    (target / "config.json").write_text(json.dumps(stale))
    write_random_model("llama-1b", tmp_path / "cache", source)
    assert json.loads((target / "config.json").read_text())["max_position_embeddings"] == MAX_POSITION_EMBEDDINGS


def test_the_gemma3_shape_is_a_hybrid_gemma3_config(tmp_path: Path) -> None:
    from deepinfer.models.config import ModelConfig

    target = write_random_model("gemma3-1b", tmp_path / "cache", tokenizer_dir(tmp_path))
    config = ModelConfig.from_hf_config(json.loads((target / "config.json").read_text()))
    assert config.architecture == "Gemma3ForCausalLM" and config.vocab_size == 1000
    assert config.sliding_window == 512 and config.layer_types.count("full_attention") == 4
    assert config.num_hidden_layers == 26 and config.max_position_embeddings == 32768
