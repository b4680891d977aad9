"""The CPU's modules: what `install` turns a model's plain modules into when it runs on the CPU (EngineCore).

    nn.Linear  -> kernels.cpu_linear.CpuLinear: float32 through oneDNN's matmul instead of MKL's sgemm
    layers.MLP -> CpuMLP: float32 prompt rows with SiLU-and-multiply fused into the gate and up GEMMs

Same parameters and state dict; other dtypes, and tensor-parallel modules, run as they did.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels import cpu_linear
from deepinfer.models.layers import MLP


class CpuMLP(MLP):
    """layers.MLP whose gate/up product and activation are `cpu_linear.silu_and_mul_linear` (the same value as the
    twin's silu_and_mul of the fused projection, within float32's rounding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(cpu_linear.silu_and_mul_linear(x, self.gate_up_proj.weight))


def install(model: nn.Module) -> None:
    """Turn the model's plain nn.Linear modules into CpuLinear and its single-rank SwiGLU MLPs (layers.MLP exactly,
    with CpuLinear projections and the twin's activation) into CpuMLP, in place."""
    cpu_linear.install(model)
    for module in model.modules():
        if (type(module) is MLP and type(module.gate_up_proj) is cpu_linear.CpuLinear
                and type(module.down_proj) is cpu_linear.CpuLinear and module.gate_up_proj.bias is None
                and getattr(module.ops.silu_and_mul, "__module__", "") == "deepinfer.kernels.torch_ops"):
            module.__class__ = CpuMLP
