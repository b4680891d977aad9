"""Rotary position embedding tables: inverse frequencies per rope_type, and the cos/sin cache the kernel reads."""

from __future__ import annotations

import math
from typing import Any

import torch

from deepinfer.models.config import ModelConfig


def _default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (theta**exponent)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(config: ModelConfig, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: blend interpolated and extrapolated frequencies over a ramp; returns (inv_freq, attention factor)."""
    scaling = config.rope_scaling or {}
    base = config.rope_theta
    original = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, device="cpu").float() / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def compute_inv_freq(config: ModelConfig, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (float32, CPU) and the factor cos/sin are multiplied by."""
    rope_type = config.rope_type
    if rope_type == "yarn":
        return _yarn_inv_freq(config, rotary_dim)
    inv_freq = _default_inv_freq(config.rope_theta, rotary_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / config.rope_scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, config.rope_scaling)
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    return inv_freq, 1.0


def compute_cos_sin_cache(config: ModelConfig, rotary_dim: int) -> torch.Tensor:
    """[max_position_embeddings, rotary_dim] float32 on CPU: cos half then sin half."""
    inv_freq, attention_factor = compute_inv_freq(config, rotary_dim)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.int64, device="cpu").float()
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
