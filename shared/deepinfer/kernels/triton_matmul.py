"""Batch-invariant linear layers: a Triton matmul with one fixed tile shape, and its torch twin.

cuBLAS picks its kernel (tile shape, split-K) from the problem shape, so the same row of activations can be
reduced in a different order when the batch has another number of rows, and its output changes in the last
bits. Here every output element C[m, n] = sum_k A[m, k] * W[n, k] is reduced in one order that depends only
on K: BLOCK_K-wide chunks from k = 0 upwards, one fp32 accumulator, whatever M is, in which tile the row
sits, or how many tiles there are. Tiles (and the launch config) are fixed, never tuned per shape.

    C [M, N] tiles:  | (0,0) (0,1) ... |   program (pid_m, pid_n) owns one BLOCK_M x BLOCK_N tile;
                     | (1,0) ...       |   programs are grouped GROUP_M rows of tiles at a time (L2 reuse)

`BatchInvariantLinear` is a TorchFunctionMode that routes `torch.nn.functional.linear` (what nn.Linear and the
models' lm_head call) through one of these while it is active, so no model code changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.overrides import TorchFunctionMode

#: The one tile shape (and launch config) used for every problem; changing it changes every result's bits.
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_WARPS, NUM_STAGES = 128, 128, 64, 8, 8, 3
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, F32_DOT: tl.constexpr,
):
    """C[tile] = A[rows] @ W[cols]^T (+ bias), fp32 accumulation over K in BLOCK_K chunks from 0 upwards."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k  # masked lanes load 0: adding 0 products is exact
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if F32_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with a reduction order independent of the rows of x (see the module doc)."""
    assert weight.dim() == 2 and x.shape[-1] == weight.shape[1], (
        f"x [..., {weight.shape[1]}] and weight [N, K] expected, got {tuple(x.shape)} and {tuple(weight.shape)}"
    )
    assert x.dtype == weight.dtype and x.dtype in _DTYPES, f"x {x.dtype} vs weight {weight.dtype}"
    assert bias is None or bias.shape == (weight.shape[0],), f"bias must be [{weight.shape[0]}]"
    a = x.reshape(-1, x.shape[-1])
    num_rows, (n, k) = a.shape[0], weight.shape
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out.reshape(*x.shape[:-1], n)
    f32_dot = x.device.type == "cpu"  # the Triton interpreter's numpy dot cannot multiply 16-bit floats
    grid = (triton.cdiv(num_rows, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    _linear_kernel[grid](
        a, weight, bias if bias is not None else out, out, num_rows, n, k,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
        PRECISION="ieee" if x.dtype == torch.float32 or f32_dot else "tf32", F32_DOT=f32_dot,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out.reshape(*x.shape[:-1], n)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of `linear`: one F.linear per row, so each row always sees the one-row kernel (slow; CPU)."""
    a = x.reshape(-1, x.shape[-1])
    rows = [F.linear(a[i : i + 1], weight, bias) for i in range(a.shape[0])]
    out = torch.cat(rows) if rows else a.new_empty(0, weight.shape[0])
    return out.reshape(*x.shape[:-1], weight.shape[0])


class BatchInvariantLinear(TorchFunctionMode):
    """While active, torch.nn.functional.linear runs `impl` (a batch-invariant linear) instead.

    Scoped, not global: the runner enters it around the model forward, the logits and CUDA-graph capture.
    """

    def __init__(self, impl: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.impl = impl

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return self.impl(*args, **kwargs)
        return func(*args, **kwargs)
