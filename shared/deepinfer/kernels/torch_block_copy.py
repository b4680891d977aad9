"""Torch twins of the block copies: whole KV blocks of every layer ⇄ rows in the KV payload format.

A row is one block of every layer, layer-major (the format of engine.kv_transfer.export_blocks, the host tier's
slots and the store's payloads), raw bytes of the cache dtype:

    K/V caches, per layer [2, num_blocks, block_size, num_kv_heads, head_dim]:
        row = layer 0: K part ‖ V part, layer 1: K ‖ V, ...      part = block_size·num_kv_heads·head_dim elements
    latent caches, per layer [num_blocks, block_size, latent_dim]:
        row = layer 0 part, layer 1 part, ...                    part = block_size·latent_dim elements

`gather_blocks` copies cache blocks into rows, `scatter_blocks` rows into cache blocks. The twins run one
index_select / index_copy_ per layer; the Triton kernels (deepinfer.kernels.triton_block_copy) do all layers in
one launch, reading each layer's address from a `LayerTable` built once for the caches (the twins accept it and
need none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerTable:
    """Where each layer's cache lives, for one launch over all layers: element offsets from layer 0."""

    #: [num_layers] int64 on the caches' device: (layer's data_ptr - layer 0's) / element size.
    offsets: torch.Tensor
    #: Each layer's data_ptr when built (a table is checked against the caches it is used with).
    data_ptrs: tuple[int, ...]


def layer_table(kv_caches: Sequence[torch.Tensor]) -> LayerTable:
    """The LayerTable of these caches: build it once (it uploads a small tensor, and waits for the upload)."""
    first = check_caches(kv_caches)
    data_ptrs = tuple(kv.data_ptr() for kv in kv_caches)
    offsets_bytes = [ptr - data_ptrs[0] for ptr in data_ptrs]
    if any(off % first.element_size() for off in offsets_bytes):
        raise ValueError("layer caches are not aligned to their element size relative to layer 0")
    offsets = [off // first.element_size() for off in offsets_bytes]
    return LayerTable(torch.tensor(offsets, dtype=torch.int64, device=first.device), data_ptrs)


def is_latent(kv: torch.Tensor) -> bool:
    """A latent (MLA) cache [num_blocks, block_size, latent_dim], not a K/V one."""
    return kv.dim() == 3


def block_part(kv: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_planes, plane stride, block stride, part numel) of a cache, in elements: a block's part of a plane
    is part numel contiguous elements at plane·plane stride + block·block stride."""
    if is_latent(kv):
        return 1, 0, kv.stride(0), kv.shape[1] * kv.shape[2]
    return 2, kv.stride(0), kv.stride(1), kv.shape[2] * kv.shape[3] * kv.shape[4]


def check_caches(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every layer has layer 0's shape, dtype, device and strides, and a block's part of a plane is contiguous;
    returns layer 0."""
    if not kv_caches:
        raise ValueError("kv_caches is empty")
    first = kv_caches[0]
    if not is_latent(first) and (first.dim() != 5 or first.shape[0] != 2):
        raise ValueError(
            "kv cache must be [2, num_blocks, block_size, num_kv_heads, head_dim] or "
            f"[num_blocks, block_size, latent_dim], got {tuple(first.shape)}"
        )
    inner = first.shape[-(first.dim() - (1 if is_latent(first) else 2)):]
    expected_inner = torch.empty(inner, device="meta").stride()
    if first.stride()[-len(inner):] != expected_inner:
        raise ValueError(f"a block's part of the cache must be contiguous, got strides {first.stride()}")
    for layer, kv in enumerate(kv_caches):
        if (kv.shape, kv.stride(), kv.dtype, kv.device) != (first.shape, first.stride(), first.dtype, first.device):
            raise ValueError(
                f"layer {layer}: {tuple(kv.shape)} {kv.stride()} {kv.dtype} on {kv.device} differs from layer 0's "
                f"{tuple(first.shape)} {first.stride()} {first.dtype} on {first.device}"
            )
    return first


def check_rows(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Caches as check_caches, block_ids [n] int64 and rows [n, block nbytes] uint8 with unit-stride rows, all on
    the caches' device; returns layer 0."""
    first = check_caches(kv_caches)
    num_planes, _, _, part = block_part(first)
    row_nbytes = len(kv_caches) * num_planes * part * first.element_size()
    if block_ids.dim() != 1 or block_ids.dtype != torch.int64 or block_ids.device != first.device:
        raise ValueError(f"block_ids must be [n] int64 on {first.device}, got {tuple(block_ids.shape)} "
                         f"{block_ids.dtype} on {block_ids.device}")
    if rows.dtype != torch.uint8 or rows.shape != (block_ids.shape[0], row_nbytes) or rows.device != first.device:
        raise ValueError(f"rows must be [{block_ids.shape[0]}, {row_nbytes}] uint8 on {first.device}, got "
                         f"{tuple(rows.shape)} {rows.dtype} on {rows.device}")
    if rows.stride(1) != 1 or rows.stride(0) % first.element_size():
        raise ValueError(f"rows need unit-stride rows aligned to the cache dtype, got strides {rows.stride()}")
    return first


def _typed_rows(first: torch.Tensor, num_layers: int, rows: torch.Tensor) -> torch.Tensor:
    """rows [n, block nbytes] uint8 → [n, num_layers, *block shape] in the cache dtype (a view)."""
    dim = 0 if is_latent(first) else 1
    block_shape = [size for i, size in enumerate(first.shape) if i != dim]
    return rows.view(first.dtype).view(rows.shape[0], num_layers, *block_shape)


def gather_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor, table: LayerTable | None = None
) -> None:
    """Copy blocks block_ids of every layer into the rows of out [n, block nbytes] (uint8), in the payload format.
    table: unused here (the Triton kernel's)."""
    first = check_rows(kv_caches, block_ids, out)
    if block_ids.numel() == 0:
        return
    dim = 0 if is_latent(first) else 1
    typed = _typed_rows(first, len(kv_caches), out)
    for layer, kv in enumerate(kv_caches):
        typed[:, layer].copy_(kv.index_select(dim, block_ids).movedim(dim, 0))


def scatter_blocks(
    rows: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, table: LayerTable | None = None
) -> None:
    """Copy rows [n, block nbytes] (uint8, the payload format) into blocks block_ids (distinct) of every layer.
    table: unused here (the Triton kernel's)."""
    first = check_rows(kv_caches, block_ids, rows)
    if block_ids.numel() == 0:
        return
    dim = 0 if is_latent(first) else 1
    typed = _typed_rows(first, len(kv_caches), rows)
    for layer, kv in enumerate(kv_caches):
        kv.index_copy_(dim, block_ids, typed[:, layer].movedim(0, dim))
