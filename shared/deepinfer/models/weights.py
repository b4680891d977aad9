"""Copy Hugging Face tensors into our (partly fused) parameters, with errors that name the tensor."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from deepinfer.distributed.weights import FusedShards


def _expected_hf_names(params: Mapping[str, torch.Tensor], fused: FusedShards) -> set[str]:
    names: set[str] = set()
    for name in params:
        module, _, leaf = name.rpartition(".")
        parent, _, local = module.rpartition(".")
        if local in fused:
            names.update(f"{parent}.{part}.{leaf}" for part, _ in fused[local])
        else:
            names.add(name)
    return names


def _resolve(hf_name: str, fused: FusedShards) -> tuple[str, int | None, int | None]:
    """HF tensor name -> (our parameter name, row offset, rows) ; offset is None for unfused tensors."""
    module, _, leaf = hf_name.rpartition(".")
    parent, _, local = module.rpartition(".")
    for fused_name, parts in fused.items():
        offset = 0
        for part, rows in parts:
            if local == part:
                return f"{parent}.{fused_name}.{leaf}", offset, rows
            offset += rows
    return hf_name, None, None


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    fused: FusedShards,
    ignore: Callable[[str], bool],
) -> None:
    """Load every tensor into its parameter; unknown names, shape mismatches and missing ones raise ValueError."""
    params = dict(model.named_parameters())
    expected = _expected_hf_names(params, fused)
    loaded: set[str] = set()
    with torch.no_grad():
        for hf_name, tensor in weights:
            if ignore(hf_name):
                continue
            name, offset, rows = _resolve(hf_name, fused)
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} does not match any parameter of this model")
            target = param.data if offset is None else param.data.narrow(0, offset, rows)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"shape mismatch for tensor {hf_name!r}: checkpoint has {tuple(tensor.shape)}, "
                    f"model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(hf_name)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
