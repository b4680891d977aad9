"""Triton SiLU-and-mul: the gated activation of SwiGLU MLPs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton_rounding import round_to

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, inter_size, BLOCK: tl.constexpr):
    """One (row, column block): out[t, i] = silu(x[t, i]) * x[t, I + i], rounded as the torch twin."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter_size
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter_size + offs, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    # the twin rounds silu(gate) to x's dtype before the product, so do the same
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, round_to(act * up.to(tl.float32), dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I] -> [T, I]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got {tuple(x.shape)}"
    assert x.stride(1) == 1 and x.dtype in _DTYPES, f"x needs a unit last stride and a float dtype, got {x.dtype}"
    num_tokens, inter_size = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter_size, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or inter_size == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter_size))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter_size, block))](
        x, out, x.stride(0), out.stride(0), inter_size, BLOCK=block, num_warps=4,
    )
    return out
