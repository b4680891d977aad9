"""Copy KV blocks by id between two caches in one pass, the source possibly on a peer GPU of the same host.

Each cache is viewed as [outer, num_blocks, block_elems] (outer = 2 for K/V caches [2, N, bs, H, D], 1 for latent
caches [N, bs, C]); program (i, o, t) copies tile t of block src_ids[i] to block dst_ids[i] in slice o. Launched
on the destination GPU, it reads the source's memory directly over NVLink (peer access), so a same-host KV pull
is one kernel per layer instead of gather + staging copy + scatter.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

TILE = 4096  # elements per program: 8 KiB of bf16


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, src_outer_stride, dst_outer_stride,
                        block_elems, TILE: tl.constexpr):
    """One tile of one (block pair, outer slice)."""
    i = tl.program_id(0)
    outer = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * TILE + tl.arange(0, TILE)
    mask = offs < block_elems
    src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    x = tl.load(src_ptr + outer * src_outer_stride + src_block * block_elems + offs, mask=mask)
    tl.store(dst_ptr + outer * dst_outer_stride + dst_block * block_elems + offs, x, mask=mask)


def copy_blocks_by_id(
    src_caches: Sequence[torch.Tensor], src_block_ids: Sequence[int], dst_caches: Sequence[torch.Tensor],
    dst_block_ids: Sequence[int], block_dim: int,
) -> None:
    """dst[..., dst_block_ids[i], ...] = src[..., src_block_ids[i], ...] along `block_dim`, every layer, launched on
    the destination's device. Caches must be contiguous; the caller has checked ids, shapes and dtypes."""
    device = dst_caches[0].device
    src_ids = torch.tensor(list(src_block_ids), dtype=torch.int32, device=device)
    dst_ids = torch.tensor(list(dst_block_ids), dtype=torch.int32, device=device)
    first = src_caches[0]
    outer, block_elems = math.prod(first.shape[:block_dim]), math.prod(first.shape[block_dim + 1 :])
    grid = (len(src_block_ids), outer, triton.cdiv(block_elems, TILE))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for src, dst in zip(src_caches, dst_caches, strict=True):
            assert src.is_contiguous() and dst.is_contiguous(), "block copies need contiguous caches"
            _copy_blocks_kernel[grid](
                src, dst, src_ids, dst_ids, src.shape[block_dim] * block_elems, dst.shape[block_dim] * block_elems,
                block_elems, TILE=TILE, num_warps=4,
            )

