"""The Hugging Face directory loader: shards, dtypes, tied embeddings, and errors that name the culprit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.kernels import build_attention_metadata, get_ops
from deepinfer.loader.hf import (
    iter_safetensors,
    load_generation_config,
    load_model,
    load_model_config,
)
from deepinfer.models import ModelConfig, supported_architectures
from deepinfer.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _load(path, dtype=torch.float32, progress=False):
    return load_model(path, dtype, torch.device("cpu"), get_ops("cpu"), progress=progress)


def _logits(model, token_ids):
    c = model.config
    caches = [torch.randn(2, 8, 4, c.num_kv_heads, c.head_dim, dtype=c_dtype(model)) for _ in range(c.num_hidden_layers)]
    n = len(token_ids)
    meta = build_attention_metadata([n], [n], [list(range(-(-n // 4)))], list(range(n)))
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(token_ids), torch.arange(n), caches, meta))


def c_dtype(model):
    return model.model.embed_tokens.weight.dtype


def _rewrite_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = make_tiny_checkpoint(tmp_path / "single", "llama", seed=5)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "llama", seed=5, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    names = [name for name, _ in iter_safetensors(sharded)]
    assert sorted(names) == sorted(index["weight_map"])
    a, b = _load(single), _load(sharded)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    token_ids = [5, 9, 77, 130, 4, 250]
    assert torch.equal(_logits(a, token_ids), _logits(b, token_ids))


def test_progress_bar_goes_to_stderr_only_when_asked(tmp_path, capfd):
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    capfd.readouterr()
    _load(path, progress=False)
    assert capfd.readouterr().err == ""
    _load(path, progress=True)
    captured = capfd.readouterr()
    assert "loading weights" in captured.err and captured.out == ""


def test_bfloat16_load_keeps_rope_table_in_float32(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    model = _load(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    rotary = model.model.layers[0].self_attn.rotary
    assert rotary.cos_sin_cache.dtype == torch.float32
    reference = _load(path)
    torch.testing.assert_close(rotary.cos_sin_cache, reference.model.layers[0].self_attn.rotary.cos_sin_cache)
    logits = _logits(model, [10, 20, 30, 40, 50])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tied_embeddings_without_lm_head(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path, arch, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = _load(path)
    hidden = torch.randn(3, model.config.hidden_size)
    expected = hidden @ model.model.embed_tokens.weight.T
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_missing_directory_config_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        _load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(tmp_path)
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors\.index\.json and model\.safetensors"):
        _load(path)


def test_unsupported_architecture_is_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        _load(path)
    for name in supported_architectures():
        assert name in str(info.value)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    name = "model.layers.1.self_attn.k_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:16].contiguous()

    _rewrite_weights(path, shrink)
    with pytest.raises(ValueError, match="shape mismatch") as info:
        _load(path)
    assert name in str(info.value) and "(16, 64)" in str(info.value) and "(32, 64)" in str(info.value)


def test_unknown_and_missing_tensors_are_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen2")
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        _load(path)
    path = make_tiny_checkpoint(tmp_path / "b", "qwen2")
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.v_proj.bias"))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.self_attn\.v_proj\.bias"):
        _load(path)


def test_generation_config(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    assert load_generation_config(path)["eos_token_id"] == load_model_config(path).eos_token_ids[0]
    (path / "generation_config.json").unlink()
    assert load_generation_config(path) == {}


def test_model_config_from_transformers4_style_json():
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    }
    config = ModelConfig.from_hf_config(hf)
    assert config.head_dim == 128 and config.num_kv_heads == 8
    assert config.rope_theta == 500000.0 and config.rope_type == "llama3"
    assert config.eos_token_ids == (128001, 128008, 128009) and config.torch_dtype == "bfloat16"
    # Llama-3.1-8B: 128 KiB of KV per token in bf16 (ANCHORS.md).
    assert config.kv_bytes_per_token(torch.bfloat16) == 128 * 1024 == config.kv_bytes_per_token("bfloat16")
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf_config({**hf, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_packages_import_without_torch():
    code = (
        "import sys, deepinfer.loader, deepinfer.models\n"
        "from deepinfer.models import ModelConfig, supported_architectures\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
