"""Triton block copies: whole KV blocks of every layer ⇄ payload-format rows, in ONE launch for all layers.

Twins and the row format: deepinfer.kernels.torch_block_copy (one index_select / index_copy_ per layer, i.e. 32+
launches for an 8B model; the host tier's copies were bound by those launches). Here the layers, separate tensors
of one shape, dtype and strides, are reached from layer 0's pointer plus an element offset per layer read from a
LayerTable (built once per set of caches). Grid (block, layer, plane · tile): each program copies one tile of a
block's contiguous part of one plane:

    cache: layer0 + offsets[layer] + plane·plane_stride + block_ids[i]·block_stride + tile·TILE + [0, TILE)
    row i: rows + i·row_stride + (layer·num_planes + plane)·PART + tile·TILE + [0, TILE)

The bytes move as integers of the dtype's size, so a copy is exact whatever they hold (NaN payloads included).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from deepinfer.kernels.torch_block_copy import LayerTable, block_part, check_rows, layer_table

__all__ = ["LayerTable", "gather_blocks", "layer_table", "scatter_blocks"]

#: Bytes per program: a tile of a block's part (16 KiB: eight 16-byte loads in flight per thread at 4 warps).
TILE_BYTES = 16 << 10
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _block_copy_kernel(
    cache_ptr, layer_offsets_ptr, block_ids_ptr, rows_ptr, plane_stride, block_stride, row_stride,
    PART: tl.constexpr, NUM_PLANES: tl.constexpr, NUM_TILES: tl.constexpr, TILE: tl.constexpr,
    LAYER_ALIGN: tl.constexpr, TO_ROWS: tl.constexpr,
):
    """One tile of one block's part of one plane of one layer: cache → row (TO_ROWS) or row → cache."""
    i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    plane = tl.program_id(2) // NUM_TILES
    tile = tl.program_id(2) % NUM_TILES
    block = tl.load(block_ids_ptr + i)
    # the layers' offsets are multiples of LAYER_ALIGN elements (checked on the host): vector loads stay legal
    layer_offset = tl.multiple_of(tl.load(layer_offsets_ptr + layer), LAYER_ALIGN)
    offs = tile * TILE + tl.arange(0, TILE)
    cache = cache_ptr + layer_offset + plane.to(tl.int64) * plane_stride + block * block_stride + offs
    row = rows_ptr + i * row_stride + (layer * NUM_PLANES + plane).to(tl.int64) * PART + offs
    if PART % TILE == 0:
        if TO_ROWS:
            tl.store(row, tl.load(cache))
        else:
            tl.store(cache, tl.load(row))
    else:
        mask = offs < PART
        if TO_ROWS:
            tl.store(row, tl.load(cache, mask=mask), mask=mask)
        else:
            tl.store(cache, tl.load(row, mask=mask), mask=mask)


def gather_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor, table: LayerTable | None = None
) -> None:
    """Copy blocks block_ids of every layer into the rows of out [n, block nbytes] (uint8), in the payload format,
    in one launch. table: layer_table(kv_caches), built once (None: built now, which waits for its upload).
    block_ids are not range-checked (that would wait for the device): ids from the block pool only."""
    _launch(kv_caches, block_ids, out, table, to_rows=True)


def scatter_blocks(
    rows: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, table: LayerTable | None = None
) -> None:
    """Copy rows [n, block nbytes] (uint8, the payload format) into blocks block_ids (distinct: a repeated id is a
    race) of every layer, in one launch. table: as gather_blocks'."""
    _launch(kv_caches, block_ids, rows, table, to_rows=False)


def _launch(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, rows: torch.Tensor,
            table: LayerTable | None, to_rows: bool) -> None:
    first = check_rows(kv_caches, block_ids, rows)
    assert block_ids.is_contiguous(), "block_ids must be contiguous"
    if table is not None and (table.data_ptrs != tuple(kv.data_ptr() for kv in kv_caches)
                              or table.offsets.device != first.device):
        raise ValueError("the LayerTable was built for other caches")
    num_blocks = block_ids.shape[0]
    if num_blocks == 0:
        return
    table = table if table is not None else layer_table(kv_caches)
    itemsize = first.element_size()
    words = _WORDS[itemsize]
    num_planes, plane_stride, block_stride, part = block_part(first)
    tile = min(TILE_BYTES // itemsize, triton.next_power_of_2(part))
    num_tiles = triton.cdiv(part, tile)
    # the largest power of two (up to 16 bytes) dividing every layer's byte offset from layer 0
    layer_align_bytes = math.gcd(16, *(ptr - table.data_ptrs[0] for ptr in table.data_ptrs))
    grid = (num_blocks, len(kv_caches), num_planes * num_tiles)
    _block_copy_kernel[grid](
        first.view(words), table.offsets, block_ids, rows.view(words), plane_stride, block_stride,
        rows.stride(0) // itemsize,
        PART=part, NUM_PLANES=num_planes, NUM_TILES=num_tiles, TILE=tile,
        LAYER_ALIGN=max(1, layer_align_bytes // itemsize), TO_ROWS=to_rows, num_warps=4,
    )
