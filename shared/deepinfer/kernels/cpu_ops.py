"""The CPU's faster ops, with the torch twins' signatures and semantics (the twins stay the reference).

Attention goes through torch's fused SDPA kernels (sdpa_paged, sdpa_varlen); float32 linears (the logits here, the
model's nn.Linear modules through `cpu_linear.install`) through oneDNN (cpu_linear). The KV write and RoPE below are
the twins with fewer torch calls: at decode every layer runs them on a few rows, where each call's dispatch costs
more than its arithmetic (RoPE rotates q and k in one pass where k's heads follow q's in memory). RMSNorm in float32 is torch's own
F.rms_norm (one call, bit for bit the twin). Every other op stays its twin.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.kernels import cpu_linear, torch_ops
from deepinfer.kernels.sdpa_paged import AttentionPlan, mla_paged_attention, paged_attention
from deepinfer.kernels.sdpa_varlen import varlen_causal_attention


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`torch_ops.reshape_and_cache`; when no slot is padding (< 0), as in every eager step, without its
    boolean-mask gathers: two index_copy_ calls."""
    if slot_mapping.numel() == 0 or int(slot_mapping.min()) < 0:
        torch_ops.reshape_and_cache(key, value, kv_cache, slot_mapping)
        return
    torch_ops.check_cache_write(key, value, kv_cache, slot_mapping)
    flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])  # [2, num_slots, Hkv, D]
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_ops.rotary_embedding`; the NeoX style (every Llama-family model) rotates each half straight into
    its output, the GPT-J style goes to the twin."""
    if not is_neox:
        return torch_ops.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    torch_ops.check_rotary_call(positions, query, key, cos_sin_cache)
    cos, sin = _cos_sin(positions, cos_sin_cache, query.dtype)
    both = _side_by_side(query, key)
    if both is None:
        return _rotate_neox(query, cos, sin), _rotate_neox(key, cos, sin)
    rotated = _rotate_neox(both, cos, sin)  # [T, Hq + Hkv, D]
    return rotated[:, : query.shape[1]], rotated[:, query.shape[1] :]


def _cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each row's position, [T, 1, rotary_dim // 2] each in dtype (as the twin's)."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).to(dtype)  # [T, 1, rotary_dim]
    return cos_sin[..., :half], cos_sin[..., half:]


def _side_by_side(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """query [T, Hq, D] and key [T, Hkv, D] as one view [T, Hq + Hkv, D] when key's heads follow query's in each row
    of the same memory (the q and k columns of the fused QKV projection's output): one rotation for both. None
    otherwise (separate tensors: Qwen3's normed q/k, MLA's)."""
    num_tokens, num_heads, head_dim = query.shape
    if (key.dtype != query.dtype or key.shape[0] != num_tokens or key.shape[2] != head_dim
            or key.stride() != query.stride() or query.stride(2) != 1 or query.stride(1) != head_dim
            or key.data_ptr() != query.data_ptr() + num_heads * head_dim * query.element_size()
            or key.untyped_storage().data_ptr() != query.untyped_storage().data_ptr()):
        return None
    return query.as_strided((num_tokens, num_heads + key.shape[1], head_dim), query.stride())


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with cos/sin [T, 1, rotary_dim // 2]: (x1 cos - x2 sin, x2 cos + x1 sin, the rest as is)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half : 2 * half]
    torch.mul(x1, cos, out=out1).sub_(x2 * sin)
    torch.mul(x2, cos, out=out2).add_(x1 * sin)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half :] = x[..., 2 * half :]
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`torch_ops.rms_norm`; float32 through torch's own F.rms_norm: the same arithmetic in the same order (bit for
    bit the twin's), one call from Python instead of the twin's seven. Other dtypes go to the twin (it rounds the normalised
    rows to x's dtype before the weight, F.rms_norm does not)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2:
        return torch_ops.rms_norm(x, weight, eps)
    assert weight.shape == (x.shape[1],), f"rms_norm wants weight [{x.shape[1]}], got {tuple(weight.shape)}"
    return F.rms_norm(x, (x.shape[1],), weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_ops.fused_add_rms_norm` over this module's rms_norm: (rms_norm(x + residual), x + residual)."""
    return torch_ops.fused_add_rms_norm(x, residual, weight, eps, rms_norm)


def overrides() -> dict[str, Callable[..., Any]]:
    """Op name -> CPU implementation, for `deepinfer.kernels.get_ops("cpu")`."""
    return {
        "reshape_and_cache": reshape_and_cache,
        "rotary_embedding": rotary_embedding,
        "paged_attention": paged_attention,
        "attention_plan": AttentionPlan,
        "mla_paged_attention": mla_paged_attention,
        "varlen_causal_attention": varlen_causal_attention,
        "linear": cpu_linear.linear,
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
    }
