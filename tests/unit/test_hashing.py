"""Block identity: chained hashes, model fingerprint, layout id (deepinfer.hashing)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from deepinfer.hashing import (
    BLOCK_HASH_BYTES,
    hash_block,
    hash_blocks,
    layout_id,
    model_fingerprint,
    pack_token_ids,
    root_hash,
)

FINGERPRINT = hashlib.sha256(b"test-model").digest()


def _sha16(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def test_known_answer_chain():
    token_ids = [1, 2, 3, 4, 70000, 0, 2**32 - 1, 5, 9, 9]  # 2 full blocks of 4, tail of 2
    root = _sha16(FINGERPRINT + "tenant-ä".encode())
    h0 = _sha16(root + struct.pack("<4I", 1, 2, 3, 4))
    h1 = _sha16(h0 + struct.pack("<4I", 70000, 0, 2**32 - 1, 5))

    assert BLOCK_HASH_BYTES == 16
    assert root_hash(FINGERPRINT, "tenant-ä") == root
    assert hash_block(root, token_ids[:4]) == h0
    assert hash_blocks(token_ids, 4, FINGERPRINT, "tenant-ä") == [h0, h1]
    assert all(len(h) == 16 for h in (root, h0, h1))


def test_u32_little_endian_packing():
    assert pack_token_ids([1, 256, 2**32 - 1]) == b"\x01\x00\x00\x00" + b"\x00\x01\x00\x00" + b"\xff" * 4


def test_chaining_and_continuation():
    token_ids = list(range(100, 132))
    full = hash_blocks(token_ids, 8, FINGERPRINT, "")
    assert len(full) == 4
    for i in range(1, 4):
        assert hash_block(full[i - 1], token_ids[8 * i : 8 * (i + 1)]) == full[i]
    # continuing from a block's hash gives the same chain as hashing everything at once
    assert hash_blocks(token_ids[16:], 8, b"ignored", "ignored", start_parent=full[1]) == full[2:]
    # a change in an early block changes every later hash
    changed = hash_blocks([0] + token_ids[1:], 8, FINGERPRINT, "")
    assert all(a != b for a, b in zip(full, changed, strict=True))


def test_salt_and_fingerprint_isolation():
    token_ids = list(range(32))
    base = hash_blocks(token_ids, 16, FINGERPRINT, "tenant-a")
    other_salt = hash_blocks(token_ids, 16, FINGERPRINT, "tenant-b")
    other_model = hash_blocks(token_ids, 16, hashlib.sha256(b"other").digest(), "tenant-a")
    assert not set(base) & set(other_salt)
    assert not set(base) & set(other_model)


def test_partial_tail_not_hashed():
    token_ids = list(range(10))
    assert len(hash_blocks(token_ids, 4, FINGERPRINT, "")) == 2
    assert hash_blocks(token_ids, 4, FINGERPRINT, "") == hash_blocks(token_ids[:8], 4, FINGERPRINT, "")
    assert hash_blocks(token_ids[:3], 4, FINGERPRINT, "") == []


@pytest.mark.parametrize("bad", [2**32, -1])
def test_token_id_outside_u32_rejected(bad):
    with pytest.raises(ValueError, match="u32"):
        hash_block(b"\x00" * 16, [1, bad, 2])
    with pytest.raises(ValueError, match="u32"):
        hash_blocks([bad, 1, 2, 3], 4, FINGERPRINT, "")


def _write_safetensors(path: Path, data: bytes, dtype: str = "U8") -> None:
    header = json.dumps(
        {"w": {"dtype": dtype, "shape": [len(data)], "data_offsets": [0, len(data)]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    _write_safetensors(tmp_path / "model.safetensors", bytes(range(256)) * 16)
    return tmp_path


def test_fingerprint_stable_and_canonical(model_dir: Path):
    first = model_fingerprint(model_dir)
    assert len(first) == 32
    assert model_fingerprint(model_dir) == first
    # the same config with other key order and whitespace is the same model
    (model_dir / "config.json").write_text('{\n  "num_hidden_layers": 2,\n  "hidden_size": 64\n}\n')
    assert model_fingerprint(model_dir) == first


@pytest.mark.parametrize(
    "change",
    ["config", "tokenizer", "weights_data", "weights_header", "new_weight_file"],
)
def test_fingerprint_changes_with_the_model(model_dir: Path, change: str):
    before = model_fingerprint(model_dir)
    if change == "config":
        (model_dir / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 3}))
    elif change == "tokenizer":
        (model_dir / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    elif change == "weights_data":
        _write_safetensors(model_dir / "model.safetensors", bytes(reversed(range(256))) * 16)
    elif change == "weights_header":
        _write_safetensors(model_dir / "model.safetensors", bytes(range(256)) * 16, dtype="I8")
    else:
        _write_safetensors(model_dir / "model-00002.safetensors", b"\x01" * 64)
    assert model_fingerprint(model_dir) != before


def test_fingerprint_reads_only_head_and_tail_of_large_weights(tmp_path: Path):
    weights = tmp_path / "model.safetensors"
    data = bytearray(b"\x07" * (10 << 20))
    _write_safetensors(weights, bytes(data))
    base = model_fingerprint(tmp_path)

    data[5 << 20] ^= 0xFF  # the middle of a 10 MiB file is never read
    _write_safetensors(weights, bytes(data))
    assert model_fingerprint(tmp_path) == base

    data[0] ^= 0xFF  # the first bytes are
    _write_safetensors(weights, bytes(data))
    assert model_fingerprint(tmp_path) != base


def test_fingerprint_of_a_gguf_file_and_revision_pin(tmp_path: Path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * (3 << 20))
    base = model_fingerprint(gguf)
    assert model_fingerprint(tmp_path) == base  # the file or the directory holding only it: the same model
    blob = bytearray(gguf.read_bytes())
    blob[-1] = 1  # past the first MiB: a GGUF's tensors sit at its end
    gguf.write_bytes(bytes(blob))
    assert model_fingerprint(gguf) != base

    assert model_fingerprint(tmp_path, revision="v1.2") == hashlib.sha256(b"v1.2").digest()
    assert model_fingerprint(tmp_path / "missing", revision="v1.2") == hashlib.sha256(b"v1.2").digest()


def test_fingerprint_of_an_empty_dir_fails(tmp_path: Path):
    with pytest.raises(ValueError, match="nothing to fingerprint"):
        model_fingerprint(tmp_path)


def test_layout_id():
    base = dict(dtype="bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
    lid = layout_id(**base)
    assert len(lid) == 16 and int(lid, 16) >= 0
    assert layout_id(**base) == lid
    assert layout_id(**{**base, "dtype": "torch.bfloat16"}) == lid
    variants = [
        {"dtype": "float16"},
        {"block_size": 32},
        {"num_layers": 31},
        {"num_kv_heads": 4},
        {"head_dim": 128},
        {"kv_layout": "hnd"},
        {"latent_dim": 512},
    ]
    ids = {layout_id(**{**base, **v}) for v in variants}
    assert len(ids) == len(variants) and lid not in ids
