"""Load a tensor-parallel model shard from whole tensors: each rank keeps only its slice.

Two sources: Hugging Face checkpoint tensors (q_proj, k_proj, ... named as in the file) or the parameters of
the single-rank model (our fused names), which is how random "dummy" weights stay identical at every tp_size.
Parallel modules slice through `load_part` / `load_full`; every other parameter (norms) is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

#: fused module name -> its HF parts in order along dim 0, as (part name, rows).
FusedShards = Mapping[str, Sequence[tuple[str, int]]]


def _split_name(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module, leaf


def _resolve(hf_name: str, fused: FusedShards) -> tuple[str, str, str]:
    """HF tensor name -> (our module path, leaf, HF part name or "" when unfused)."""
    module, leaf = _split_name(hf_name)
    parent, _, local = module.rpartition(".")
    for fused_name, parts in fused.items():
        if any(local == part for part, _ in parts):
            return f"{parent}.{fused_name}" if parent else fused_name, leaf, local
    return module, leaf, ""


def _expected_hf_names(model: nn.Module, fused: FusedShards) -> set[str]:
    names: set[str] = set()
    for name, _ in model.named_parameters():
        module, leaf = _split_name(name)
        parent, _, local = module.rpartition(".")
        if local in fused:
            names.update(f"{parent}.{part}.{leaf}" for part, _ in fused[local])
        else:
            names.add(name)
    return names


def _copy_into(model: nn.Module, module_path: str, leaf: str, part: str, tensor: torch.Tensor, what: str) -> None:
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        raise ValueError(f"checkpoint tensor {what!r} does not match any parameter of this model") from None
    if hasattr(module, "load_part"):
        if part:
            module.load_part(leaf, part, tensor)
        else:
            module.load_full(leaf, tensor)
        return
    param = getattr(module, leaf, None)
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"checkpoint tensor {what!r} does not match any parameter of this model")
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"shape mismatch for tensor {what!r}: checkpoint has {tuple(tensor.shape)}, "
            f"model expects {tuple(param.shape)}"
        )
    param.data.copy_(tensor)


def load_sharded_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    fused: FusedShards,
    ignore: Callable[[str], bool],
) -> None:
    """Load whole HF tensors into a shard; unknown names, shape mismatches and missing ones raise ValueError."""
    expected = _expected_hf_names(model, fused)
    loaded: set[str] = set()
    with torch.no_grad():
        for hf_name, tensor in weights:
            if ignore(hf_name):
                continue
            module_path, leaf, part = _resolve(hf_name, fused)
            _copy_into(model, module_path, leaf, part, tensor, hf_name)
            loaded.add(hf_name)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def load_full_parameters(model: nn.Module, parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load the parameters of the single-rank model (same names, whole tensors) into a shard; every
    parameter of the shard must be given."""
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in parameters:
            module_path, leaf = _split_name(name)
            _copy_into(model, module_path, leaf, "", tensor, name)
            loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"{len(missing)} parameter(s) not given: {', '.join(missing[:10])}")
