"""The one-launch block copies (gather_blocks / scatter_blocks) against their torch twins and the payload format of
export_blocks / import_blocks, byte for byte, in Triton's interpreter on the CPU (the `ops` fixture imports fresh
copies of triton and of our kernel modules with TRITON_INTERPRET=1, as test_kernels_triton.py does).

Caches hold random bits (NaN patterns included: a copy must move bytes, not values); both layouts, K/V
[2, num_blocks, bs, H, D] and latent [num_blocks, bs, dim]; layers allocated apart (offsets from layer 0 of any
sign) or carved from one buffer at offsets no multiple of 16 bytes; parts of one tile, of a ragged tile and
of several tiles."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from deepinfer.engine.block_pool import BlockPool
from deepinfer.engine.host_tier import HostTier
from deepinfer.engine.kv_transfer import block_nbytes, export_blocks, import_blocks
from deepinfer.kernels import get_ops, torch_block_copy
from deepinfer.testing.triton_interpret import interpreted_kernels

NUM_BLOCKS = 48
SHAPES = {  # name -> per-layer cache shape (num_blocks in its place)
    "kv": (2, NUM_BLOCKS, 4, 2, 8),  # part = 64 elements: one tile
    "kv-ragged": (2, NUM_BLOCKS, 3, 3, 5),  # 45 elements: one masked tile
    "latent": (NUM_BLOCKS, 4, 12),
    "kv-tiles": (2, NUM_BLOCKS, 16, 2, 160),  # 5120: fp32 two tiles of 4096 (the second masked), bf16 one of 8192
    "latent-tiles": (NUM_BLOCKS, 16, 576),  # 9216 (the DeepSeek latent row): fp32 three tiles, bf16 two
}
SIZES = [1, 2, 3, 5, 8, 13, 21, 34, 40]


@pytest.fixture(scope="module")
def ops() -> Iterator[SimpleNamespace]:
    """Our Triton kernel modules in Triton's interpreter, as one namespace."""
    with interpreted_kernels(("triton_block_copy", "triton_ops")) as modules:
        yield modules


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def random_bits(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A tensor of random bytes seen as dtype (NaNs and infinities included)."""
    numel = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def make_caches(layout: str, dtype: torch.dtype, num_layers: int = 3, carved: bool = False, seed: int = 0):
    """Per-layer caches of random bits: separate tensors, or views of one buffer, one element before each."""
    g = torch.Generator().manual_seed(seed)
    shape = SHAPES[layout]
    if not carved:
        return [random_bits(shape, dtype, g) for _ in range(num_layers)]
    numel = torch.Size(shape).numel()
    flat = random_bits((num_layers * (numel + 1),), dtype, g)
    return [flat[1 + i * (numel + 1) : (i + 1) * (numel + 1)].view(shape) for i in range(num_layers)]


def as_bytes(kv_caches) -> list[torch.Tensor]:
    return [kv.view(torch.uint8) for kv in kv_caches]


def rows_for(kv_caches, n: int) -> torch.Tensor:
    return torch.full((n, block_nbytes(kv_caches)), 0xA5, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", list(SHAPES))
def test_gather_and_scatter_match_the_twins_and_the_payload_format(ops, layout, dtype):
    kv_caches = make_caches(layout, dtype)
    table = ops.triton_block_copy.layer_table(kv_caches)
    rng = random.Random(1)
    for n in SIZES:
        block_ids = rng.sample(range(1, NUM_BLOCKS), n)
        ids = torch.tensor(block_ids)
        rows, twin_rows = rows_for(kv_caches, n), rows_for(kv_caches, n)
        ops.triton_block_copy.gather_blocks(kv_caches, ids, rows, table)
        torch_block_copy.gather_blocks(kv_caches, ids, twin_rows)
        assert torch.equal(rows, twin_rows), n
        assert [rows[i].numpy().tobytes() for i in range(n)] == export_blocks(kv_caches, block_ids), n

        targets = rng.sample(range(1, NUM_BLOCKS), n)  # distinct, scattered, may overlap the sources
        written = [kv.clone() for kv in kv_caches]
        twin_written = [kv.clone() for kv in kv_caches]
        imported = [kv.clone() for kv in kv_caches]
        ops.triton_block_copy.scatter_blocks(rows, written, torch.tensor(targets))
        torch_block_copy.scatter_blocks(rows, twin_written, torch.tensor(targets))
        import_blocks(imported, targets, [rows[i].numpy().tobytes() for i in range(n)])
        assert all(map(torch.equal, as_bytes(written), as_bytes(twin_written))), n
        assert all(map(torch.equal, as_bytes(written), as_bytes(imported))), n


@pytest.mark.parametrize("layout", ["kv", "latent"])
def test_layers_carved_from_one_buffer_off_alignment_and_repeated_gather_ids(ops, layout):
    kv_caches = make_caches(layout, torch.bfloat16, num_layers=4, carved=True, seed=2)
    assert kv_caches[0].data_ptr() % 16 and (kv_caches[1].data_ptr() - kv_caches[0].data_ptr()) % 16
    block_ids = [7, 3, 7, 40, 1, 3]  # a gather may read a block twice (export_blocks does)
    rows = rows_for(kv_caches, len(block_ids))
    ops.triton_block_copy.gather_blocks(kv_caches, torch.tensor(block_ids), rows)
    assert [rows[i].numpy().tobytes() for i in range(len(block_ids))] == export_blocks(kv_caches, block_ids)

    written = [kv.clone() for kv in kv_caches]  # separate tensors now: the rows go back to other blocks
    ops.triton_block_copy.scatter_blocks(rows[2:], written, torch.tensor([2, 5, 9, 47]))
    expected = [kv.clone() for kv in kv_caches]
    import_blocks(expected, [2, 5, 9, 47], [rows[i].numpy().tobytes() for i in range(2, 6)])
    assert all(map(torch.equal, as_bytes(written), as_bytes(expected)))


def test_bad_arguments_are_refused_before_a_launch(ops):
    kv_caches = make_caches("kv", torch.float32)
    other = make_caches("kv", torch.float32, seed=3)
    ids = torch.tensor([1, 2])
    kernel = ops.triton_block_copy
    with pytest.raises(ValueError, match="other caches"):
        kernel.gather_blocks(kv_caches, ids, rows_for(kv_caches, 2), kernel.layer_table(other))
    with pytest.raises(ValueError, match="rows must be"):
        kernel.gather_blocks(kv_caches, ids, rows_for(kv_caches, 3))
    with pytest.raises(ValueError, match="block_ids must be"):
        kernel.scatter_blocks(rows_for(kv_caches, 2), kv_caches, ids.int())
    with pytest.raises(ValueError, match="differs from layer 0"):
        kernel.gather_blocks([kv_caches[0], kv_caches[1].to(torch.bfloat16)], ids, rows_for(kv_caches, 2))
    with pytest.raises(ValueError, match="contiguous"):
        kernel.gather_blocks([kv.transpose(3, 4) for kv in kv_caches], ids, rows_for(kv_caches, 2))
    empty = rows_for(kv_caches, 0)
    kernel.gather_blocks(kv_caches, torch.tensor([], dtype=torch.long), empty)  # nothing to copy, no launch


@pytest.mark.parametrize("layout", ["kv", "latent"])
def test_the_host_tier_offloads_and_loads_through_the_kernels(ops, layout):
    """HostTier's copies (the CPU path: gather into rows, then the slots) with the interpreted kernels as its ops:
    each slot holds its block's payload, and a load writes those bytes into other blocks."""
    kv_caches = make_caches(layout, torch.bfloat16, num_layers=3, seed=4)
    triton_ops = replace(get_ops("cpu"), gather_blocks=ops.triton_block_copy.gather_blocks,
                         scatter_blocks=ops.triton_block_copy.scatter_blocks)
    tier = HostTier(kv_caches, 64, BlockPool(NUM_BLOCKS, enable_kv_events=False), ops=triton_ops)
    rng = random.Random(5)
    for n in (1, 6, 23):
        block_ids, slots = rng.sample(range(1, NUM_BLOCKS), n), rng.sample(range(64), n)
        assert tier.copy_to_host(block_ids, slots) is None
        assert [tier.host[s].numpy().tobytes() for s in slots] == export_blocks(kv_caches, block_ids)
        targets = rng.sample(range(1, NUM_BLOCKS), n)
        expected = [kv.clone() for kv in kv_caches]
        import_blocks(expected, targets, export_blocks(kv_caches, block_ids))
        assert tier.copy_to_device(slots, targets) is None
        assert all(map(torch.equal, as_bytes(kv_caches), as_bytes(expected)))
