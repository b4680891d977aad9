"""Kernel ops behind one small interface, chosen once at start from the accelerator.

Models receive a `KernelOps` and never branch on the device. The torch twins (`torch_ops`) define the
semantics; faster implementations (the CPU's SDPA attention, the Triton kernels) plug in through
`_accelerated_overrides`, the one place that knows them.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from deepinfer.kernels import torch_block_copy, torch_mla, torch_moe, torch_ops
from deepinfer.kernels.metadata import AttentionMetadata, build_attention_metadata

__all__ = [
    "ACCELERATORS",
    "AttentionMetadata",
    "KernelOps",
    "batch_invariant_linear",
    "build_attention_metadata",
    "get_ops",
    "resolve_accelerator",
]

logger = logging.getLogger(__name__)

ACCELERATORS = ("cpu", "cuda", "ascend")

#: accelerator -> module that may provide faster ops through `overrides() -> dict[op name, callable]`.
#: The CPU runs attention through torch's fused SDPA kernels (cpu_ops), the twins for the rest. CUDA 13 images
#: run the Triton kernels; CANN 9.2 images (torch_npu + triton-ascend) compile the same kernel source for Ascend
#: NPUs. The Ascend path is UNTESTED HARDWARE: no CI or team machine has an NPU; only this selection logic is
#: tested (on the CPU).
_ACCELERATED_MODULES = {
    "cpu": "deepinfer.kernels.cpu_ops",
    "cuda": "deepinfer.kernels.triton_ops",
    "ascend": "deepinfer.kernels.triton_ops",
}


@dataclass(frozen=True)
class KernelOps:
    """The ops a model calls; every field has the signature of its torch twin (`torch_ops`, `torch_mla`,
    `torch_moe`, `torch_block_copy`); the DeepSeek ops and the block copies default to their twins."""

    accelerator: str
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., Any]
    rms_norm: Callable[..., Any]
    fused_add_rms_norm: Callable[..., Any]
    rotary_embedding: Callable[..., Any]
    silu_and_mul: Callable[..., Any]
    #: Gemma's GeGLU; the twin everywhere (no faster kernel yet)
    gelu_tanh_and_mul: Callable[..., Any] = torch_ops.gelu_tanh_and_mul
    fused_moe: Callable[..., Any] = torch_moe.fused_moe
    #: (query, out, meta) -> plan; plan(kv_cache, scale, sliding_window) writes paged_attention into out
    attention_plan: Callable[..., Any] = torch_ops.AttentionPlan
    mla_paged_attention: Callable[..., Any] = torch_mla.mla_paged_attention
    mla_cache_write: Callable[..., None] = torch_mla.mla_cache_write
    varlen_causal_attention: Callable[..., Any] = torch_mla.varlen_causal_attention
    gather_blocks: Callable[..., None] = torch_block_copy.gather_blocks
    scatter_blocks: Callable[..., None] = torch_block_copy.scatter_blocks
    #: F.linear for the logits (the model's nn.Linear modules are the CPU's `cpu_linear.install`'s business)
    linear: Callable[..., Any] = torch_ops.linear

    def implementations(self) -> dict[str, str]:
        """Op name -> 'module.function' that implements it (for logs and start-up banners)."""
        return {
            f.name: f"{getattr(self, f.name).__module__}.{getattr(self, f.name).__name__}"
            for f in fields(self)
            if f.name != "accelerator"
        }


def _torch_twins(accelerator: str) -> KernelOps:
    return KernelOps(
        accelerator=accelerator,
        reshape_and_cache=torch_ops.reshape_and_cache,
        paged_attention=torch_ops.paged_attention,
        rms_norm=torch_ops.rms_norm,
        fused_add_rms_norm=torch_ops.fused_add_rms_norm,
        rotary_embedding=torch_ops.rotary_embedding,
        silu_and_mul=torch_ops.silu_and_mul,
        gelu_tanh_and_mul=torch_ops.gelu_tanh_and_mul,
        fused_moe=torch_moe.fused_moe,
        attention_plan=torch_ops.AttentionPlan,
        mla_paged_attention=torch_mla.mla_paged_attention,
        mla_cache_write=torch_mla.mla_cache_write,
        varlen_causal_attention=torch_mla.varlen_causal_attention,
        gather_blocks=torch_block_copy.gather_blocks,
        scatter_blocks=torch_block_copy.scatter_blocks,
        linear=torch_ops.linear,
    )


def _accelerated_overrides(accelerator: str) -> dict[str, Callable[..., Any]]:
    """Faster ops for this accelerator, imported lazily; {} where none exist (twins are used)."""
    module_name = _ACCELERATED_MODULES.get(accelerator)
    if module_name is None:
        return {}
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only "no such module" or "no triton installed" fall back; any other missing import is a bug to show.
        if exc.name not in (module_name, "triton"):
            raise
        logger.warning("%s kernels unavailable (%s); using the torch twins", accelerator, exc)
        return {}
    return dict(module.overrides())


def get_ops(accelerator: str) -> KernelOps:
    """KernelOps for "cpu" | "cuda" | "ascend": accelerated ops where they exist, torch twins otherwise."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {accelerator!r}; expected one of {', '.join(ACCELERATORS)}")
    ops = _torch_twins(accelerator)
    overrides = _accelerated_overrides(accelerator)
    unknown = set(overrides) - {f.name for f in fields(KernelOps)} - {"accelerator"}
    if unknown or "accelerator" in overrides:
        raise ValueError(f"{accelerator} kernels override unknown ops: {sorted(unknown)}")
    return replace(ops, **overrides)


def batch_invariant_linear(accelerator: str) -> Callable[..., Any]:
    """F.linear with a reduction order independent of the batch: the fixed-tile Triton matmul on CUDA, its
    row-by-row torch twin elsewhere (see deepinfer.kernels.triton_matmul)."""
    from deepinfer.kernels import triton_matmul

    return triton_matmul.linear if accelerator == "cuda" else triton_matmul.rowwise_linear


def resolve_accelerator(setting: str, device: Any = None) -> str:
    """Map a setting ("auto" | "cpu" | "cuda" | "ascend") and a device to the accelerator to use."""
    if setting != "auto":
        if setting not in ACCELERATORS:
            raise ValueError(f"unknown accelerator {setting!r}; expected auto or one of {', '.join(ACCELERATORS)}")
        return setting
    import torch

    if device is not None:
        # "npu" parses as a torch device only once torch_npu is imported: read the type from the string first.
        device_type = device.split(":", 1)[0] if isinstance(device, str) else torch.device(device).type
        return {"cuda": "cuda", "npu": "ascend"}.get(device_type, "cpu")
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)  # present once torch_npu is imported
    if npu is not None and npu.is_available():
        return "ascend"
    return "cpu"
