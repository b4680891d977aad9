"""Triton implementations of the kernel interface, with the torch twins' signatures (see torch_ops)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.sdpa_varlen import varlen_causal_attention
from deepinfer.kernels.triton_activation import silu_and_mul
from deepinfer.kernels.triton_attention import paged_decode_attention, prefill_attention
from deepinfer.kernels.triton_block_copy import gather_blocks, scatter_blocks
from deepinfer.kernels.triton_cache import reshape_and_cache
from deepinfer.kernels.triton_mla import mla_cache_write, mla_paged_attention
from deepinfer.kernels.triton_moe import fused_moe
from deepinfer.kernels.triton_norm import fused_add_rms_norm, rms_norm
from deepinfer.kernels.triton_rotary import rotary_embedding

__all__ = [
    "fused_add_rms_norm",
    "fused_moe",
    "gather_blocks",
    "mla_cache_write",
    "mla_paged_attention",
    "overrides",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "scatter_blocks",
    "silu_and_mul",
    "varlen_causal_attention",
]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode batches (max_query_len <= 1) take the split-K decode kernel, prompt-only batches the prefill one;
    a mixed step both: its single-row sequences the decode kernel, the others the prefill kernel."""
    # the choice reads only host ints, so it never waits for the device
    if meta.max_query_len <= 1:
        return paged_decode_attention(query, kv_cache, meta, scale, sliding_window)
    if not meta.num_decodes:  # 0, or not counted (None): every row through the prefill kernel
        return prefill_attention(query, kv_cache, meta, scale, sliding_window)
    out = prefill_attention(query, kv_cache, meta, scale, sliding_window, min_query_len=2)
    return paged_decode_attention(query, kv_cache, meta, scale, sliding_window, out=out)


def overrides() -> dict[str, Callable[..., Any]]:
    """Op name -> Triton implementation, for `deepinfer.kernels.get_ops("cuda")`."""
    return {
        "reshape_and_cache": reshape_and_cache,
        "paged_attention": paged_attention,
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "rotary_embedding": rotary_embedding,
        "silu_and_mul": silu_and_mul,
        "fused_moe": fused_moe,
        "mla_paged_attention": mla_paged_attention,
        "mla_cache_write": mla_cache_write,
        "varlen_causal_attention": varlen_causal_attention,
        "gather_blocks": gather_blocks,
        "scatter_blocks": scatter_blocks,
    }
