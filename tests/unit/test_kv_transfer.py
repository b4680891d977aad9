"""KV block export/import between paged caches: bitwise round trips, the payload order, size checks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from deepinfer.engine.kv_transfer import (
    LayoutMismatch,
    block_nbytes,
    check_layout,
    export_blocks,
    import_blocks,
    kv_layout_of,
)
from deepinfer.protocol import KvHandle


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    seed: int,
    device: str = "cpu",
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.randn(shape, generator=gen).to(dtype=dtype, device=device) for _ in range(num_layers)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


SHAPES = [  # (num_layers, block_size, num_kv_heads, head_dim): MHA, GQA with few KV heads, one KV head (MQA)
    (3, 4, 4, 8),
    (2, 16, 2, 64),
    (4, 8, 1, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"L{s[0]}-bs{s[1]}-h{s[2]}-d{s[3]}" for s in SHAPES])
def test_round_trip_between_two_caches_is_bitwise(dtype, shape):
    num_layers, block_size, num_kv_heads, head_dim = shape
    src = _caches(num_layers, 12, block_size, num_kv_heads, head_dim, dtype, seed=1)
    dst = _caches(num_layers, 9, block_size, num_kv_heads, head_dim, dtype, seed=2)
    before = [kv.clone() for kv in dst]
    src_ids, dst_ids = [7, 2, 11, 5], [3, 8, 1, 6]

    payloads = export_blocks(src, src_ids)
    assert all(isinstance(p, bytes) and len(p) == block_nbytes(src) for p in payloads)
    import_blocks(dst, dst_ids, payloads)

    for layer in range(num_layers):
        assert torch.equal(_bits(dst[layer][:, dst_ids]), _bits(src[layer][:, src_ids]))
        untouched = [b for b in range(9) if b not in dst_ids]
        assert torch.equal(_bits(dst[layer][:, untouched]), _bits(before[layer][:, untouched]))


def test_payload_is_layer_major_k_then_v_little_endian():
    src = _caches(2, 5, 4, 2, 8, torch.float32, seed=3)
    (payload,) = export_blocks(src, [3])
    # Independent reading of the documented order: float32 little-endian [layer, k/v, block_size, heads, dim].
    arr = np.frombuffer(payload, dtype="<f4").reshape(2, 2, 4, 2, 8)
    for layer in range(2):
        np.testing.assert_array_equal(arr[layer, 0], src[layer][0, 3].numpy())
        np.testing.assert_array_equal(arr[layer, 1], src[layer][1, 3].numpy())


def test_bf16_payload_is_the_raw_two_byte_words():
    src = _caches(1, 3, 2, 1, 4, torch.bfloat16, seed=4)
    (payload,) = export_blocks(src, [1])
    words = np.frombuffer(payload, dtype="<u2").reshape(2, 2, 1, 4)
    expected = src[0][:, 1].view(torch.int16).numpy().astype(np.uint16)
    np.testing.assert_array_equal(words, expected)
    assert len(payload) == 2 * 2 * 1 * 4 * 2


def test_wrong_payload_size_is_rejected_naming_the_block():
    src = _caches(2, 6, 4, 2, 8, torch.float32, seed=5)
    payloads = export_blocks(src, [1, 2])
    dst = _caches(2, 6, 4, 2, 8, torch.float32, seed=6)
    before = [kv.clone() for kv in dst]
    with pytest.raises(ValueError, match=r"block id 5 \(#1\)"):
        import_blocks(dst, [4, 5], [payloads[0], payloads[1][:-2]])
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))  # nothing written


def test_a_payload_of_another_layout_does_not_fit():
    bf16 = export_blocks(_caches(2, 4, 4, 2, 8, torch.bfloat16, seed=7), [1])
    fp32 = _caches(2, 4, 4, 2, 8, torch.float32, seed=8)
    with pytest.raises(ValueError, match="bytes"):
        import_blocks(fp32, [1], bf16)


@pytest.mark.parametrize("block_ids", [[0], [6], [-1]], ids=["padding", "past-end", "negative"])
def test_block_ids_outside_the_pool_are_rejected(block_ids):
    caches = _caches(1, 6, 2, 1, 4, torch.float32, seed=9)
    with pytest.raises(ValueError, match="outside"):
        export_blocks(caches, block_ids)


def test_duplicate_import_ids_are_rejected():
    caches = _caches(1, 6, 2, 1, 4, torch.float32, seed=10)
    payloads = export_blocks(caches, [1, 2])
    with pytest.raises(ValueError, match="duplicate"):
        import_blocks(caches, [3, 3], payloads)


def test_layers_must_agree():
    caches = _caches(2, 6, 2, 1, 4, torch.float32, seed=11)
    caches[1] = caches[1].to(torch.bfloat16)
    with pytest.raises(ValueError, match="layer 1"):
        block_nbytes(caches)


def test_kv_layout_of_and_check_layout():
    caches = _caches(3, 6, 16, 2, 8, torch.bfloat16, seed=12)
    layout = kv_layout_of(caches, 16, "torch.bfloat16")
    assert (layout.dtype, layout.block_size, layout.num_layers, layout.num_kv_heads, layout.head_dim) == (
        "bfloat16",
        16,
        3,
        2,
        8,
    )
    assert block_nbytes(caches) == 3 * 2 * 16 * 2 * 8 * 2
    with pytest.raises(ValueError, match="block_size"):
        kv_layout_of(caches, 8, "bfloat16")
    with pytest.raises(ValueError, match="float16"):
        kv_layout_of(caches, 16, "float16")

    other = kv_layout_of(_caches(3, 6, 16, 2, 8, torch.float32, seed=13))
    handle = KvHandle(
        request_id="r",
        block_hashes=[b"\x01" * 16],
        block_ids=[1],
        num_tokens=16,
        owner_worker_id="p0",
        data_plane_address="127.0.0.1:1",
        layout=other,
        layout_id=other.layout_id(),
        lease_expires_at_unix_s=0.0,
    )
    check_layout(handle, other)
    with pytest.raises(LayoutMismatch, match="float32"):
        check_layout(handle, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_on_device(dtype):
    src = _caches(3, 40, 16, 2, 64, dtype, seed=14, device="cuda")
    dst = _caches(3, 40, 16, 2, 64, dtype, seed=15, device="cuda")
    src_ids, dst_ids = list(range(1, 33)), list(range(39, 7, -1))
    import_blocks(dst, dst_ids, export_blocks(src, src_ids))
    torch.cuda.synchronize()
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(_bits(a[:, src_ids]), _bits(b[:, dst_ids]))


@pytest.mark.parametrize("latent", [False, True])
def test_import_rows_writes_what_import_blocks_writes(latent):
    from deepinfer.engine.kv_transfer import StagingPool, import_rows
    from deepinfer.kernels import get_ops

    gen = torch.Generator().manual_seed(7)
    shape = (9, 4, 24) if latent else (2, 9, 4, 2, 8)
    source = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(3)]
    payloads = export_blocks(source, [3, 1, 5])
    by_blocks = [torch.zeros_like(kv) for kv in source]
    by_rows = [torch.zeros_like(kv) for kv in source]
    import_blocks(by_blocks, [6, 2, 8], payloads)
    pool = StagingPool(block_nbytes(source), chunk_blocks=4, num_chunks=1, pin=False)
    chunk = asyncio.run(pool.acquire())
    for view, payload in zip(chunk.views, payloads, strict=False):
        view[:] = payload
    assert import_rows(by_rows, [6, 2, 8], chunk.rows[:3], get_ops("cpu")) is None  # CPU: done on return
    for a, b in zip(by_blocks, by_rows, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert _bits(by_rows[0]).abs().sum() > 0


def test_import_rows_refuses_wrong_rows_and_ids():
    from deepinfer.engine.kv_transfer import import_rows
    from deepinfer.kernels import get_ops

    caches = _caches(2, 5, 4, 2, 8, torch.float32, seed=1)
    rows = torch.zeros((2, block_nbytes(caches)), dtype=torch.uint8)
    with pytest.raises(ValueError, match="rows must be"):
        import_rows(caches, [1, 2, 3], rows, get_ops("cpu"))
    with pytest.raises(ValueError, match="padding block"):
        import_rows(caches, [0, 1], rows, get_ops("cpu"))
    with pytest.raises(ValueError, match="duplicate"):
        import_rows(caches, [2, 2], rows, get_ops("cpu"))
