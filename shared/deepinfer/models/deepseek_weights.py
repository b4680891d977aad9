"""Hugging Face DeepSeek tensor names -> our parameters (fused gate/up, stacked experts, MTP layers).

    model.layers.{i}.mlp.gate_proj / up_proj             -> model.layers.{i}.mlp.gate_up_proj   (row halves)
    model.layers.{i}.mlp.experts.{e}.gate_proj / up_proj -> ...mlp.experts.gate_up_proj[e]      (row halves)
    model.layers.{i}.mlp.experts.{e}.down_proj           -> ...mlp.experts.down_proj[e]
    model.layers.{L + k}.*  (L = num_hidden_layers)      -> mtp_layers.{k}.*  (their embed_tokens and
                                                            shared_head.head copies are the main model's)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_GATE_UP = re.compile(r"^(.*)\.(gate_proj|up_proj)\.weight$")

#: Tensors an MTP layer stores that are the main model's (shared embedding and output head).
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def _our_name(hf_name: str, num_layers: int) -> str | None:
    """Our name before fusing: MTP layers renamed, shared MTP copies and RoPE tables -> None (skipped)."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    match = _LAYER.match(hf_name)
    if match is None or int(match.group(1)) < num_layers:
        return hf_name
    if match.group(2) in _MTP_SHARED:
        return None
    return f"mtp_layers.{int(match.group(1)) - num_layers}.{match.group(2)}"


def _target(params: dict[str, nn.Parameter], name: str) -> tuple[str, torch.Tensor, str]:
    """(parameter name, the view of it this tensor fills, a key unique to that view)."""
    expert = _EXPERT.match(name)
    if expert is not None:
        prefix, index, proj = expert.group(1), int(expert.group(2)), expert.group(3)
        fused = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
        view = params[fused].data[index] if fused in params else None
        if view is not None and proj != "down_proj":
            half = view.shape[0] // 2
            view = view[:half] if proj == "gate_proj" else view[half:]
        return fused, view, f"{index}.{proj}"
    gate_up = _GATE_UP.match(name)
    if gate_up is not None and name not in params:
        fused = f"{gate_up.group(1)}.gate_up_proj.weight"
        if fused in params:
            half = params[fused].shape[0] // 2
            rows = slice(0, half) if gate_up.group(2) == "gate_proj" else slice(half, None)
            return fused, params[fused].data[rows], gate_up.group(2)
    param = params.get(name)
    return name, None if param is None else param.data, "all"


def load_deepseek_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], num_layers: int, optional: set[str]
) -> set[str]:
    """Copy every tensor into its parameter; returns the names of parameters nothing was loaded into.

    Unknown names, shape mismatches, duplicates and missing parameters not in `optional` raise ValueError.
    """
    params = dict(model.named_parameters())
    loaded_numel = dict.fromkeys(params, 0)
    seen: set[tuple[str, str]] = set()
    with torch.no_grad():
        for hf_name, tensor in weights:
            name = _our_name(hf_name, num_layers)
            if name is None:
                continue
            param_name, view, key = _target(params, name)
            if view is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} does not match any parameter of this model")
            if tuple(tensor.shape) != tuple(view.shape):
                raise ValueError(
                    f"shape mismatch for tensor {hf_name!r}: checkpoint has {tuple(tensor.shape)}, "
                    f"model expects {tuple(view.shape)}"
                )
            if (param_name, key) in seen:
                raise ValueError(f"checkpoint tensor {hf_name!r} fills a parameter already loaded")
            seen.add((param_name, key))
            view.copy_(tensor)
            loaded_numel[param_name] += view.numel()
    empty = {name for name, numel in loaded_numel.items() if numel == 0}
    partial = sorted(name for name, numel in loaded_numel.items() if 0 < numel < params[name].numel())
    missing = sorted(empty - optional) + partial
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) (or parts of them): {shown}")
    return empty
