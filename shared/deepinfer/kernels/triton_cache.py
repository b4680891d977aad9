"""Triton KV-cache write: scatter this step's K/V rows into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_co, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One token: copy its [Hkv, D] key and value rows to slot_mapping[t]; a slot < 0 is padding."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    if slot < 0:
        return
    # slot = block * block_size + offset  ->  cache[block, offset, h, d]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    cache_offs = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_offs, k, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_offs, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write K/V rows [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] in place; slot < 0 skipped."""
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.is_contiguous(), (
        f"kv_cache must be contiguous [2, num_blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}"
    )
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert key.shape == value.shape and key.dim() == 3 and key.shape[1:] == (num_kv_heads, head_dim), (
        f"key/value must be [T, {num_kv_heads}, {head_dim}], got {tuple(key.shape)} and {tuple(value.shape)}"
    )
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value need a unit stride on head_dim"
    assert key.dtype == value.dtype == kv_cache.dtype, f"dtypes differ: {key.dtype}, {value.dtype}, {kv_cache.dtype}"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (key.shape[0],), "slot_mapping: [T] int64"
    assert slot_mapping.is_contiguous()
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache[0], kv_cache[1], slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, num_warps=4,
    )
