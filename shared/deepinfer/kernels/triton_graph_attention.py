"""Paged attention of a step with prompt rows, inside a CUDA graph: launches fixed per token bucket.

A captured graph replays the same grids with the same arguments, so no launch of a step captured for a bucket of
n rows may depend on the step's host ints (its number of sequences, its longest prompt), as the eager
`paged_attention`'s do. Graph mode (engine.full_graphs) fixes them from the bucket and moves the step's layout
into static device buffers, refilled before each replay:

    query_start_loc [S+1], seq_lens [S]   S = min(max_num_seqs, n) slots; the step's B sequences first, then
                                          empty ones (no new row, seq_len 0)
    block_tables [S, W]                   W = max_model_len's blocks; a slot's columns past its blocks unread
    prefill_tiles [1 + 2 * capacity]      the number of tiles, each tile's sequence, each tile's query block

A tile is BLOCK_M new rows of one sequence with at least two new rows; the host lists them (`write_prefill_tiles`)
and a fixed grid of (programs, query heads) walks the list, each program every programs-th tile, through the
eager kernel's tile body (triton_attention._prefill_block). The single-row sequences (decodes beside the prompts)
go to the decode kernel as in an eager mixed step: a grid of S sequence slots, one partition each, the empty and
multi-row slots exiting at once. `capacity` bounds any step of n rows: sum(ceil(q_i / BLOCK_M)) <= ceil(n /
BLOCK_M) + P, with P <= min(S, n // 2) sequences of two or more rows. The output starts as zeros, so the bucket's
padding rows come back as zeros, as in the eager path. The torch twin is torch_ops.paged_attention (it reads the
host lists and ignores the tiles).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.triton_attention import (
    _LOG2E,
    _check_attention_inputs,
    _f32_dot,
    _precision,
    _prefill_block,
    paged_decode_attention,
)
from deepinfer.kernels.triton_launch import Launch, launch_now

#: Programs a graph-mode prefill launch starts per query head, at least (more for buckets of more query blocks).
_MIN_PROGRAMS = 16


def graph_block_m(dtype: torch.dtype) -> int:
    """The query rows of a graph-mode tile: the eager kernel's tile for a 64-row prompt (32 in float32)."""
    return 32 if dtype == torch.float32 else 64


def prefill_tile_capacity(num_tokens: int, num_seqs: int, block_m: int) -> int:
    """Tiles a step of at most num_tokens rows over at most num_seqs sequences can need (see the module doc)."""
    return -(-num_tokens // block_m) + min(num_seqs, num_tokens // 2)


def write_prefill_tiles(query_lens: np.ndarray, block_m: int, capacity: int, out: np.ndarray) -> int:
    """Write the tiles of the sequences with >= 2 new rows into `out` (count, sequences, query blocks; the layout
    above, `out` at least 1 + 2 * capacity long); returns the number of tiles."""
    seqs = np.flatnonzero(query_lens >= 2)
    blocks = -(-query_lens[seqs] // block_m)
    num_tiles = int(blocks.sum())
    if num_tiles > capacity:
        raise ValueError(f"{num_tiles} prefill tiles exceed the bucket's capacity {capacity}")
    out[0] = num_tiles
    out[1 : 1 + num_tiles] = np.repeat(seqs, blocks)
    # each tile's block within its sequence: its index minus its sequence's first tile's index
    out[1 + capacity : 1 + capacity + num_tiles] = np.arange(num_tiles) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    return num_tiles


@triton.jit(do_not_specialize=["stride_bt", "capacity"])
def _prefill_tiles_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tiles_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_co, stride_ch,
    qk_scale, sliding_window, capacity,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """Program (p, head): tiles p, p + programs, ... of the step's list, for one query head."""
    head = tl.program_id(1)
    num_tiles = tl.load(tiles_ptr)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        b = tl.load(tiles_ptr + 1 + tile)
        m_block = tl.load(tiles_ptr + 1 + capacity + tile)
        _prefill_block(
            out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
            m_block, b, head,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_co, stride_ch,
            qk_scale, sliding_window, 2,
            HEAD_DIM, BLOCK_D, GROUP, BLOCK_SIZE, BLOCK_M, BLOCK_N, USE_WINDOW, PRECISION, F32_DOT,
        )


def graph_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
    *, launch: Launch = launch_now,
) -> torch.Tensor:
    """Attention of a step with prompt rows over graph-mode metadata (`meta.prefill_tiles` set; the module doc):
    launches that depend only on the shapes of `query` and of the static buffers."""
    assert meta.prefill_tiles is not None, "graph_attention needs the metadata's prefill_tiles"
    _check_attention_inputs(query, kv_cache, meta)
    out = torch.zeros_like(query)
    num_tokens, num_heads, head_dim = query.shape
    block_m = graph_block_m(query.dtype)
    capacity = (meta.prefill_tiles.shape[0] - 1) // 2
    programs = max(1, min(capacity, max(_MIN_PROGRAMS, triton.cdiv(num_tokens, block_m))))
    window = sliding_window or 0
    launch(
        _prefill_tiles_kernel, (programs, num_heads), out, query, kv_cache[0], kv_cache[1], meta.block_tables,
        meta.seq_lens, meta.query_start_loc, meta.prefill_tiles,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        scale * _LOG2E, window, capacity,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), GROUP=num_heads // kv_cache.shape[3],
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_M=block_m, BLOCK_N=32 if query.dtype == torch.float32 else 64,
        USE_WINDOW=window > 0, PRECISION=_precision(query), F32_DOT=_f32_dot(query), num_warps=4, num_stages=2,
    )
    # the single-row sequences: one partition of max_seq_len (the static metadata's max_model_len) each
    return paged_decode_attention(query, kv_cache, meta, scale, sliding_window, out=out, launch=launch)
