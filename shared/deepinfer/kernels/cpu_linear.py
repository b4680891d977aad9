"""The CPU's float32 linear: oneDNN's matmul instead of MKL's sgemm (what F.linear runs for float32 on the CPU).

torch 2.13's F.linear sends float32 to MKL's sgemm (bfloat16 already goes to oneDNN). On this project's AMD EPYC
(2 threads) oneDNN's float32 matmul through `torch.ops.mkldnn._linear_pointwise` runs the same product faster:

    rows of x (M)   weights                  MKL sgemm -> oneDNN (2 threads)
    1 .. 16         all 30 layers' (cold)    1.45-2.5x: MKL runs a skinny product on one thread (1 thread: 1.1x)
                                             and streams the weights at ~11 GB/s, oneDNN splits it over both
    128 .. 512      one layer's (in cache)   1.05-1.4x
    2,048           one layer's              1.07-1.10x

(docs/cpu.md, "float32 linears through oneDNN"). Decode is weight streaming, so it gains the most. Same product in
float32 (no reduced-precision mode): only the order of the sums differs from MKL's, within float32's rounding.

`install(model)` turns every plain `nn.Linear` of a model into a `CpuLinear` (same parameters, same state dict),
whose forward is `linear` below (`deepinfer.models.cpu.install` calls it for every model the engine runs on the CPU,
and fuses the SwiGLU MLP's activation into its GEMMs: `silu_and_mul_linear`); `linear` is also the CPU's `KernelOps.linear` (the logits). Other dtypes, grad
mode with a trainable weight, and any active TorchFunctionMode (the runner's batch-invariant linear mode, which
replaces F.linear) go to F.linear as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels import torch_ops

#: oneDNN's matmul with no fused op after it.
_onednn_linear = torch.ops.mkldnn._linear_pointwise
#: Whether this torch build carries oneDNN (all x86 and aarch64 wheels do).
_HAS_ONEDNN = torch.backends.mkldnn.is_available()


#: From this many rows on, `silu_and_mul_linear` fuses the activation into the two GEMMs (fewer rows: one GEMM over
#: the fused weight and the twin's silu_and_mul, the fewer calls).
FUSED_MLP_MIN_ROWS = 128


def _on_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight^T goes through oneDNN: float32 CPU tensors, no autograd, no TorchFunctionMode active."""
    return (_HAS_ONEDNN and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and not (weight.requires_grad and torch.is_grad_enabled())
            and not torch._C._is_torch_function_mode_enabled())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): through oneDNN for float32 CPU tensors, else F.linear itself."""
    if not _on_onednn(x, weight):
        return F.linear(x, weight, bias)
    return _onednn_linear(x, weight, bias, "none", [], "")


def silu_and_mul_linear(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """`torch_ops.silu_and_mul(F.linear(x, gate_up_weight))` for x [T, in] and the fused gate/up weight [2I, in]
    -> [T, I]. From FUSED_MLP_MIN_ROWS rows on (float32, as `linear`), two oneDNN GEMMs with the activation in their
    epilogues: silu(x @ gate^T) (oneDNN's "swish"), then x @ up^T times it (a binary "mul"); the [T, 2I] product and
    the two passes over it are never made."""
    if x.dim() != 2 or x.shape[0] < FUSED_MLP_MIN_ROWS or not _on_onednn(x, gate_up_weight):
        return torch_ops.silu_and_mul(linear(x, gate_up_weight))
    half = gate_up_weight.shape[0] // 2
    gate = _onednn_linear(x, gate_up_weight[:half], None, "swish", [], "")
    return _onednn_linear.binary(x, gate, gate_up_weight[half:], None, "mul")


class CpuLinear(nn.Linear):
    """nn.Linear whose forward is `linear` (install() turns a model's nn.Linear modules into these)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def install(model: nn.Module) -> int:
    """Turn every plain nn.Linear of `model` (exactly that class: tensor-parallel linears stay as they are) into a
    CpuLinear, in place; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = CpuLinear
            count += 1
    return count
