"""Random "dummy" weights (vLLM's load_format="dummy"): the model of a config.json without reading a weight file."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from deepinfer.kernels import KernelOps
from deepinfer.loader.hf import load_model_config
from deepinfer.models.registry import get_model_class


def load_dummy_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    ops: KernelOps,
    seed: int = 0,
    std: float = 0.02,
) -> nn.Module:
    """Build the model of `model_dir/config.json` with random weights on `device` (vLLM's load_format="dummy").

    Weights ~ N(0, std) drawn on the device from `seed` (norm gains 1), so no weight file is read and an 8B
    model is ready in about a second. Same seed, device and dtype give the same weights.
    """
    config = load_model_config(model_dir)
    device = torch.device(device)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, ops)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
    model.rebuild_buffers()
    return model.eval()
