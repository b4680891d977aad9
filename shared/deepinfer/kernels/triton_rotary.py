"""Triton rotary position embedding (RoPE), neox and GPT-J styles, with partial rotary_dim."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton_rounding import round_to

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, t, cos, sin, partner, sign, rotated,
    num_heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[h, d] = x[h, d] * cos[d] + sign[d] * x[h, partner[d]] * sin[d] for every head of row t."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    row = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh
    x = tl.load(row + offs_d[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x_partner = tl.load(row + partner[None, :], mask=mask & rotated[None, :], other=0.0).to(tl.float32)
    # the twin rounds cos/sin and every product to the input dtype; mirror its rounding steps
    x1 = round_to(x.to(tl.float32) * cos[None, :], dtype).to(tl.float32)
    x2 = round_to(x_partner * sin[None, :], dtype).to(tl.float32)
    out = tl.where(rotated[None, :], x1 + sign[None, :] * x2, x.to(tl.float32))
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], round_to(out, dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    num_q_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One token: rotate the first 2 * ROT_HALF features of every q and k head at positions[t]."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    offs_d = tl.arange(0, BLOCK_D)
    rotated = offs_d < 2 * ROT_HALF  # features past rotary_dim pass through
    # neox:  pairs (d, d + half): freq = d % half, partner = d +- half, sign - for the first half
    # gpt-j: pairs (2i, 2i + 1):  freq = d // 2,   partner = d ^ 1,    sign - for even d
    if IS_NEOX:
        freq = offs_d % ROT_HALF
        first = offs_d < ROT_HALF
        partner = tl.where(first, offs_d + ROT_HALF, offs_d - ROT_HALF)
    else:
        freq = offs_d // 2
        first = offs_d % 2 == 0
        partner = offs_d ^ 1
    sign = tl.where(first, -1.0, 1.0)
    cs_row = cos_sin_ptr + pos * stride_cs  # cos_sin_cache[pos] = [cos(rot/2) | sin(rot/2)]
    cos = tl.load(cs_row + freq, mask=rotated, other=1.0)
    sin = tl.load(cs_row + ROT_HALF + freq, mask=rotated, other=0.0)
    dtype = q_out_ptr.dtype.element_ty
    cos = round_to(cos, dtype).to(tl.float32)
    sin = round_to(sin, dtype).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, cos, sin, partner, sign,
                  rotated, num_q_heads, HEAD_DIM, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, cos, sin, partner, sign,
                  rotated, num_kv_heads, HEAD_DIM, BLOCK_HK, BLOCK_D)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of query [T, Hq, D] and key [T, Hkv, D] at positions [T]; returns new (query, key)."""
    assert positions.dim() == 1 and positions.dtype == torch.int64 and positions.is_contiguous(), (
        "positions must be contiguous [T] int64"
    )
    assert query.dim() == 3 and key.dim() == 3 and query.shape[2] == key.shape[2], "query/key: [T, H, D]"
    assert query.shape[0] == key.shape[0] == positions.shape[0], (
        f"T differs: positions {positions.shape[0]}, query {query.shape[0]}, key {key.shape[0]}"
    )
    assert query.stride(2) == 1 and key.stride(2) == 1, "query/key need a unit stride on head_dim"
    assert query.dtype == key.dtype and query.dtype in _DTYPES, f"dtypes: query {query.dtype}, key {key.dtype}"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.dim() == 2, "cos_sin_cache: [P, rot] f32"
    assert cos_sin_cache.stride(1) == 1, "cos_sin_cache needs a unit last stride"
    rotary_dim, head_dim = cos_sin_cache.shape[1], query.shape[2]
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim, f"rotary_dim {rotary_dim} vs head_dim {head_dim}"
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if positions.shape[0] == 0:
        return q_out, k_out
    block_d = triton.next_power_of_2(head_dim)
    _rotary_kernel[(positions.shape[0],)](
        positions, query, key, q_out, k_out, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        query.shape[1], key.shape[1],
        HEAD_DIM=head_dim, ROT_HALF=rotary_dim // 2, IS_NEOX=is_neox,
        BLOCK_HQ=triton.next_power_of_2(query.shape[1]), BLOCK_HK=triton.next_power_of_2(key.shape[1]),
        BLOCK_D=block_d, num_warps=4,
    )
    return q_out, k_out
