"""Build one rank's shard of a model and fill it: from the checkpoint files, or with the single-rank dummy
weights (so that a random model is the same model at every tp_size)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from deepinfer.distributed.parallel_state import TensorParallelGroup
from deepinfer.distributed.weights import load_full_parameters
from deepinfer.kernels import KernelOps
from deepinfer.loader.dummy import load_dummy_model
from deepinfer.loader.hf import load_checkpoint_weights, load_model_config, safetensors_files
from deepinfer.models.registry import get_model_class


def build_empty_shard(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, ops: KernelOps, tp: TensorParallelGroup
) -> nn.Module:
    """This rank's shard with uninitialised parameters on `device`; ValueError if the architecture has no
    tensor-parallel support."""
    config = load_model_config(model_dir)
    model_class = get_model_class(config.architecture)
    if tp.world_size > 1 and not getattr(model_class, "supports_tensor_parallel", False):
        raise ValueError(f"{config.architecture} does not support tensor_parallel_size > 1 yet")
    with torch.device("meta"):
        model = model_class(config, ops, tp=tp) if tp.world_size > 1 else model_class(config, ops)
    return model.to(dtype=dtype).to_empty(device=device)


def load_model_shard(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    ops: KernelOps,
    tp: TensorParallelGroup,
    *,
    load_format: str = "auto",
    dummy_seed: int = 0,
    progress: bool = False,
) -> nn.Module:
    """This rank's shard of the model in `model_dir`, weights loaded, in eval mode.

    "auto" reads every checkpoint tensor and keeps this rank's slice. "dummy" draws the single-rank model's
    random weights on `device` (loader.dummy.load_dummy_model, same seed) and keeps this rank's slice, so
    TP=N and TP=1 hold the same model; that briefly needs the whole model's memory on each device.
    """
    device = torch.device(device)
    if load_format == "dummy":
        whole = load_dummy_model(model_dir, dtype, device, ops, seed=dummy_seed)
        model = build_empty_shard(model_dir, dtype, device, ops, tp)
        load_full_parameters(model, whole.named_parameters())
        del whole
    else:
        files = safetensors_files(model_dir)
        model = build_empty_shard(model_dir, dtype, device, ops, tp)
        load_checkpoint_weights(model, model_dir, files, progress)
    model.rebuild_buffers()
    return model.eval()
