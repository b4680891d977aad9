"""Load a Hugging Face model directory (config.json + safetensors) into one of our models."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from deepinfer.kernels import KernelOps
from deepinfer.models.config import ModelConfig
from deepinfer.models.registry import check_architecture, get_model_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist or is not a directory")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse `<model_dir>/config.json`; FileNotFoundError if absent, ValueError if unsupported."""
    path = _model_dir(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {str(path.parent)!r}")
    config = ModelConfig.from_hf_config(_read_json(path))
    check_architecture(config.architecture)
    return config


def load_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """Defaults from `generation_config.json` (temperature, top_p, eos_token_id, ...); {} when absent."""
    path = _model_dir(model_dir) / "generation_config.json"
    return _read_json(path) if path.is_file() else {}


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files: the shards of `model.safetensors.index.json`, else `model.safetensors`."""
    path = _model_dir(model_dir)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map") or {}
        if not weight_map:
            raise ValueError(f"{index} has an empty weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shard(s) missing from {str(path)!r}: {', '.join(absent)}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(f"no weights in {str(path)!r}: looked for {INDEX_FILE} and {SINGLE_FILE}")


def iter_safetensors(model_dir: str | Path, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF tensor name, CPU tensor) over every shard; a tqdm bar on stderr when progress is set."""
    files = safetensors_files(model_dir)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="loading weights", unit="tensor", file=sys.stderr, disable=not progress) as bar:
        for file, handle in zip(files, handles, strict=True):
            bar.set_postfix_str(file.name, refresh=False)
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, handle.get_tensor(name)
                bar.update(1)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    ops: KernelOps,
    progress: bool = True,
) -> nn.Module:
    """Build the model for `model_dir` without initialising weights, load the checkpoint, return it in eval mode."""
    config = load_model_config(model_dir)
    files = safetensors_files(model_dir)  # fail on missing weights before building anything
    model_class = get_model_class(config.architecture)
    device = torch.device(device)
    with torch.device("meta"):
        model = model_class(config, ops)
    model = model.to(dtype=dtype).to_empty(device=device)
    load_checkpoint_weights(model, model_dir, files, progress)
    model.rebuild_buffers()
    return model.eval()


def load_checkpoint_weights(model: nn.Module, model_dir: str | Path, files: list[Path], progress: bool) -> None:
    """Fill `model` (a whole model or one rank's shard) from the checkpoint; a ValueError names the files."""
    try:
        model.load_weights(iter_safetensors(model_dir, progress=progress))
    except ValueError as exc:
        raise ValueError(f"{', '.join(f.name for f in files)} in {str(model_dir)!r}: {exc}") from exc
