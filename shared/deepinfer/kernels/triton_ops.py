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
from deepinfer.kernels.triton_graph_attention import graph_attention
from deepinfer.kernels.triton_launch import Launch, LaunchRecorder, RecordedLaunch, launch_now
from deepinfer.kernels.triton_mla import mla_cache_write, mla_paged_attention
from deepinfer.kernels.triton_moe import fused_moe
from deepinfer.kernels.triton_norm import fused_add_rms_norm, rms_norm
from deepinfer.kernels.triton_rotary import rotary_embedding

__all__ = [
    "AttentionPlan",
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
    *,
    out: torch.Tensor | None = None,
    launch: Launch = launch_now,
) -> torch.Tensor:
    """Decode batches (max_query_len <= 1) take the split-K decode kernel, prompt-only batches the prefill one;
    a mixed step both: its single-row sequences the decode kernel, the others the prefill kernel. With `out`, into
    it (rows past query_start_loc[-1] left as they are), the decode rows one partition each as in a mixed step."""
    # the choice reads only host ints, so it never waits for the device
    if meta.prefill_tiles is not None:  # inside a captured graph: launches fixed by the shapes
        assert out is None, "graph-mode attention allocates its output"
        return graph_attention(query, kv_cache, meta, scale, sliding_window, launch=launch)
    if meta.max_query_len <= 1 and out is None:
        return paged_decode_attention(query, kv_cache, meta, scale, sliding_window, launch=launch)
    if not meta.num_decodes:  # 0, or not counted (None): every row through the prefill kernel
        return prefill_attention(query, kv_cache, meta, scale, sliding_window, out=out, launch=launch)
    # checks the inputs; launches nothing when no sequence has two new rows
    out = prefill_attention(query, kv_cache, meta, scale, sliding_window, min_query_len=2, out=out, launch=launch)
    return paged_decode_attention(query, kv_cache, meta, scale, sliding_window, out=out, launch=launch)


class AttentionPlan:
    """One step's paged attention, planned on its first layer and launched again for the others.

    A step with prompt rows runs attention eagerly between its piecewise CUDA graphs (engine.piecewise_graphs):
    L times the same query and output buffers and metadata, only the KV cache differs. Through `paged_attention`
    each layer pays the input checks, the grid arithmetic, Triton's binding and cache lookup for two launches,
    an output allocation and a copy into the static buffer: ~150 us a layer, 3 of the 5 ms of a mixed step of
    64 decode rows and a 32-token prompt on a 1B model (bench/gpu/mixed_step.py under py-spy). The plan runs a layer
    through `paged_attention` into `out` while a `LaunchRecorder` keeps its launches; a later layer whose cache
    matches (dtype, shape, strides, alignment: what Triton specialises on; and the same scale and window)
    replays them with its K and V pointers (triton_launch). A layer that differs records its own; where nothing
    can be recorded (the interpreter, launch hooks) every layer takes the plain path. The torch twin:
    torch_ops.AttentionPlan.
    """

    def __init__(self, query: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata) -> None:
        self.query, self.out, self.meta = query, out, meta
        self._recorded: dict[tuple, list[RecordedLaunch]] = {}
        #: Layers launched from a recording (for tests and benches).
        self.num_replays = 0
        if out.shape[0] > meta.query_start_loc_cpu[-1]:
            out[meta.query_start_loc_cpu[-1]:].zero_()  # batch padding: zeros, as paged_attention returns

    def __call__(self, kv_cache: torch.Tensor, scale: float, sliding_window: int | None = None) -> None:
        """Write the attention of this step over `kv_cache` (one layer's) into `out`."""
        key = (scale, sliding_window, kv_cache.dtype, kv_cache.shape, kv_cache.stride(), kv_cache.data_ptr() % 16)
        launches = self._recorded.get(key)
        if launches is None:
            recorder = LaunchRecorder((kv_cache[0], kv_cache[1]))
            paged_attention(self.query, kv_cache, self.meta, scale, sliding_window, out=self.out, launch=recorder)
            if recorder.launches is not None:
                self._recorded[key] = recorder.launches
            return
        key_pointer = kv_cache.data_ptr()
        pointers = (key_pointer, key_pointer + kv_cache.stride(0) * kv_cache.element_size())
        for launch in launches:
            launch(pointers)
        self.num_replays += 1


def overrides() -> dict[str, Callable[..., Any]]:
    """Op name -> Triton implementation, for `deepinfer.kernels.get_ops("cuda")`."""
    return {
        "reshape_and_cache": reshape_and_cache,
        "paged_attention": paged_attention,
        "attention_plan": AttentionPlan,
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
