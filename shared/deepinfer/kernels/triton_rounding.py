"""Round-to-nearest-even casts for Triton kernels, identical on the GPU and in Triton's CPU interpreter."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Cast float32 x to dtype rounding to nearest even (the interpreter's own fp32->bf16 cast truncates)."""
    if dtype == tl.bfloat16:
        # keep the top 16 bits, adding half an ulp (ties to even): the cast after that is exact
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    return x.to(dtype)
