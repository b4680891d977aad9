"""Triton RMSNorm and fused residual-add + RMSNorm, statistics in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton_rounding import round_to

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_xt, stride_rt, stride_ot, stride_rot, hidden_size, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One row: [x + residual ->] rms_norm, rounded like the torch twin (normalised x in x's dtype, then * weight)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    x = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0)
    x_dtype = x.dtype
    xf = x.to(tl.float32)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + t * stride_rt + offs, mask=mask, other=0.0).to(tl.float32)
        # the sum is rounded to x's dtype first: that rounded sum is both the new residual and the norm input
        summed = round_to(xf + residual, x_dtype)
        tl.store(residual_out_ptr + t * stride_rot + offs, summed, mask=mask)
        xf = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden_size + eps)
    normed = round_to(xf * rstd, x_dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, round_to(normed * weight, out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """Check the boundary, allocate outputs and run one program per row."""
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (
        f"rms_norm wants x [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}"
    )
    assert x.dtype in _DTYPES and weight.dtype in _DTYPES, f"float dtypes only, got {x.dtype}, {weight.dtype}"
    assert x.stride(1) == 1 and weight.is_contiguous(), "x needs a unit last stride; weight must be contiguous"
    num_tokens, hidden_size = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    residual_out = out
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1, (
            f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}"
        )
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        x, residual if residual is not None else x, weight, out, residual_out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), residual_out.stride(0),
        hidden_size, eps, ADD_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, H] over H, scaled by weight [H]."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual) in one pass over memory."""
    return _launch(x, residual, weight, eps)
