"""KV block identity (docs/architecture.md §4): chained block hashes, the model fingerprint and the layout id.

The same functions run in gateway, scheduler, workers and store, so all agree on which block is which:

    hash[-1] = H(model_fingerprint ‖ utf-8 cache_salt)          H = SHA-256 truncated to 16 bytes
    hash[i]  = H(hash[i-1] ‖ token_ids of block i as u32 LE)    full blocks only; a partial tail has no hash

Pure Python, no torch: import cost matters in the gateway. Identity, not storage: it sits in the lowest layer and
imports nothing of ours, so `protocol` (KvLayout.layout_id) and the store (`deepinfer.kvcache`) both build on it.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Sequence
from pathlib import Path

#: Length of every block hash (and of the root hash) in bytes.
BLOCK_HASH_BYTES = 16

#: Bytes of each weight file's data that enter the fingerprint, at its start and at its end.
FINGERPRINT_SAMPLE_BYTES = 1 << 20

#: The safetensors format caps its JSON header at 100 MB; a larger length means the file is not safetensors.
_MAX_SAFETENSORS_HEADER_BYTES = 100_000_000

_WEIGHT_SUFFIXES = (".safetensors", ".gguf")


def _h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:BLOCK_HASH_BYTES]


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian bytes; ValueError for an id outside [0, 2**32)."""
    try:
        packed = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must fit in u32 (0 <= id < 2**32): {exc}") from exc
    if packed.itemsize != 4:  # 'I' is 4 bytes on every platform CPython supports; stay exact regardless
        return struct.pack(f"<{len(packed)}I", *packed)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def root_hash(model_fingerprint: bytes, cache_salt: str) -> bytes:
    """hash[-1]: the parent of a sequence's first block, per model and tenant (cache_salt)."""
    return _h(bytes(model_fingerprint) + cache_salt.encode("utf-8"))


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block given its parent's hash."""
    return _h(bytes(parent) + pack_token_ids(token_ids))


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    model_fingerprint: bytes,
    cache_salt: str,
    start_parent: bytes | None = None,
) -> list[bytes]:
    """Chained hashes of the full blocks of token_ids (a partial tail is not hashed).

    start_parent continues a chain: token_ids then start at a block boundary after the block whose hash it is,
    and model_fingerprint / cache_salt are not used.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = root_hash(model_fingerprint, cache_salt) if start_parent is None else bytes(start_parent)
    num_full_blocks = len(token_ids) // block_size
    # Pack once, then hash byte slices: long prompts (tens of thousands of tokens) stay cheap.
    packed = pack_token_ids(token_ids[: num_full_blocks * block_size])
    stride = 4 * block_size
    hashes: list[bytes] = []
    for i in range(num_full_blocks):
        parent = _h(parent + packed[i * stride : (i + 1) * stride])
        hashes.append(parent)
    return hashes


def model_fingerprint(model_dir: Path, revision: str | None = None) -> bytes:
    """SHA-256 identifying a model's weights and tokenizer, cheap to compute (never reads whole weight files).

    With revision (an operator's pin): SHA-256 of it. Otherwise SHA-256 over the canonical config.json, the
    tokenizer.json bytes and, for each *.safetensors / *.gguf file sorted by name: its name, size, header
    (safetensors: 8-byte length + JSON header), its first MiB of data and its last MiB (a GGUF file's first MiB
    is often all metadata — the tokenizer vocabulary — so the tail is what sees its tensors). model_dir may also
    be a single weight file.
    """
    if revision is not None:
        return hashlib.sha256(revision.encode("utf-8")).digest()
    model_dir = Path(model_dir)
    if model_dir.is_file():
        config_path, tokenizer_path, weight_paths = None, None, [model_dir]
    else:
        config_path, tokenizer_path = model_dir / "config.json", model_dir / "tokenizer.json"
        weight_paths = sorted(
            (p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)),
            key=lambda p: p.name,
        )
    digest = hashlib.sha256()
    found = False
    if config_path is not None and config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        _add_part(
            digest, b"config", json.dumps(config, sort_keys=True, separators=(",", ":")).encode("utf-8")
        )
        found = True
    if tokenizer_path is not None and tokenizer_path.is_file():
        _add_part(digest, b"tokenizer", tokenizer_path.read_bytes())
        found = True
    for path in weight_paths:
        _add_weight_file(digest, path)
        found = True
    if not found:
        raise ValueError(
            f"nothing to fingerprint in {model_dir}: no config.json, tokenizer.json or weight files"
        )
    return digest.digest()


def _add_part(digest, label: bytes, data: bytes) -> None:
    # Length-prefixed parts: no two different sets of parts concatenate to the same byte string.
    digest.update(struct.pack("<I", len(label)) + label + struct.pack("<Q", len(data)))
    digest.update(data)


def _add_weight_file(digest, path: Path) -> None:
    size = path.stat().st_size
    _add_part(digest, b"weight_file", path.name.encode("utf-8") + struct.pack("<Q", size))
    with path.open("rb") as f:
        data_start = 0
        if path.name.endswith(".safetensors"):
            prefix = f.read(8)
            if len(prefix) == 8:
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > _MAX_SAFETENSORS_HEADER_BYTES or 8 + header_len > size:
                    raise ValueError(f"{path}: not a safetensors file (header length {header_len})")
                _add_part(digest, b"header", prefix + f.read(header_len))
                data_start = 8 + header_len
        f.seek(data_start)
        _add_part(digest, b"head", f.read(FINGERPRINT_SAMPLE_BYTES))
        tail_start = max(data_start, size - FINGERPRINT_SAMPLE_BYTES)
        f.seek(tail_start)
        _add_part(digest, b"tail", f.read(FINGERPRINT_SAMPLE_BYTES))


def layout_id(
    dtype: str,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_layout: str = "nhd",
    latent_dim: int | None = None,
) -> str:
    """16 hex chars naming a KV block's byte layout; the same tokens under another layout are another object.

    dtype is taken by name, with a "torch." prefix ignored ("torch.bfloat16" and "bfloat16" agree).
    """
    dtype_name = str(dtype).removeprefix("torch.")
    canonical = (
        f"dtype={dtype_name};block_size={int(block_size)};num_layers={int(num_layers)};"
        f"num_kv_heads={int(num_kv_heads)};head_dim={int(head_dim)};kv_layout={kv_layout};"
        f"latent_dim={'none' if latent_dim is None else int(latent_dim)}"
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
