"""Graph-mode paged attention (kernels.triton_graph_attention) against the torch twin, in Triton's interpreter:
the step's layout in static buffers padded to a token bucket (engine.full_graphs.GraphStepBuffers), launches
fixed by the bucket, the prefill tiles listed on the host."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deepinfer.engine.full_graphs import GraphStepBuffers
from deepinfer.kernels import torch_ops
from deepinfer.kernels.triton_graph_attention import prefill_tile_capacity, write_prefill_tiles
from deepinfer.testing.triton_interpret import interpreted_kernels
from tests.unit.test_kernels_triton import (
    ATTENTION_CASES,
    MIXED,
    _one_thread,  # noqa: F401 (autouse)
    assert_close,
    make_batch,
)

KERNEL_MODULES = ("triton_attention", "triton_graph_attention", "triton_cache", "triton_ops")


@pytest.fixture(scope="module")
def ops() -> Iterator[SimpleNamespace]:
    with interpreted_kernels(KERNEL_MODULES) as modules:
        yield modules


def graph_step(batch: SimpleNamespace, n: int, max_seqs: int) -> tuple[torch.Tensor, object]:
    """The batch's query padded to bucket n (NaN rows: the kernels must not read them) and its graph-mode metadata."""
    step = batch.meta
    buffers = GraphStepBuffers(max_seqs, step.block_tables.shape[1] + 2, n, batch.query.dtype, torch.device("cpu"))
    buffers.static.fill_(-7)  # stale contents: fill must set every element the kernels read
    buffers.block_tables.fill_(-7)
    slots = torch.full((n,), -1, dtype=torch.int64)
    buffers.fill(n, step, [])
    query = torch.full((n, *batch.query.shape[1:]), float("nan"), dtype=batch.query.dtype)
    query[: batch.query.shape[0]] = batch.query
    return query, buffers.metadata(n, slots, max_seq_len=4096)


@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype"), ATTENTION_CASES)
def test_graph_attention_matches_twin_on_a_mixed_step(ops, block_size, num_heads, num_kv_heads, head_dim, dtype):
    b = make_batch(*MIXED, block_size, num_heads, num_kv_heads, head_dim, dtype)
    num_rows = sum(MIXED[0])
    query, meta = graph_step(b, 96, max_seqs=16)
    out = ops.triton_ops.paged_attention(query, b.kv_cache, meta, head_dim**-0.5)
    assert out.shape == query.shape
    assert_close(out[:num_rows], torch_ops.paged_attention(b.query, b.kv_cache, b.meta, head_dim**-0.5))
    assert not out[num_rows:].any(), "the bucket's padding rows must come back as zeros"


@pytest.mark.parametrize(("q_lens", "seq_lens"), [
    ([70], [70]),  # one prompt over three tiles of 32 rows (float32)
    ([1, 1, 1], [40, 1, 9]),  # decodes only: no tile
    ([2, 33, 1], [2, 90, 64]),  # the shortest prompt, a prompt over a cached prefix
])
def test_graph_attention_matches_twin_on_prompt_and_decode_steps(ops, q_lens, seq_lens):
    b = make_batch(q_lens, seq_lens, 16, 4, 2, 64, torch.float32)
    query, meta = graph_step(b, 128, max_seqs=4)
    out = ops.triton_ops.paged_attention(query, b.kv_cache, meta, 0.125, sliding_window=None)
    assert_close(out[: sum(q_lens)], torch_ops.paged_attention(b.query, b.kv_cache, b.meta, 0.125))


def test_graph_attention_sliding_window_matches_twin(ops):
    b = make_batch([1, 30, 12], [100, 30, 40], 16, 8, 2, 64, torch.float32)
    query, meta = graph_step(b, 64, max_seqs=8)
    out = ops.triton_ops.paged_attention(query, b.kv_cache, meta, 0.1, sliding_window=24)
    assert_close(out[:43], torch_ops.paged_attention(b.query, b.kv_cache, b.meta, 0.1, sliding_window=24))


def test_prefill_tiles_list_each_query_block_of_each_prompt():
    out = np.full(1 + 2 * 8, -1, dtype=np.int32)
    num = write_prefill_tiles(np.array([1, 130, 0, 2, 64]), 64, 8, out)
    assert num == 5 and out[0] == 5
    assert out[1:6].tolist() == [1, 1, 1, 3, 4]  # sequences: 130 rows take three tiles of 64
    assert out[9:14].tolist() == [0, 1, 2, 0, 0]  # query blocks within each sequence
    assert write_prefill_tiles(np.array([1, 1]), 64, 8, out) == 0 and out[0] == 0
    with pytest.raises(ValueError, match="capacity"):
        write_prefill_tiles(np.array([65, 65]), 64, 3, out)


@pytest.mark.parametrize("num_tokens", [2, 3, 16, 64, 100, 512])
def test_tile_capacity_bounds_every_layout_of_a_bucket(num_tokens):
    """The worst layouts of n rows over at most S sequences: prompts of 2 rows, or of BLOCK_M + 1 rows."""
    for block_m, max_seqs in ((64, 256), (32, 4), (64, 1)):
        capacity = prefill_tile_capacity(num_tokens, min(max_seqs, num_tokens), block_m)
        for q_len in (2, block_m + 1, num_tokens):
            count = min(max_seqs, num_tokens // q_len) if q_len <= num_tokens else 0
            q_lens = [q_len] * count + [1] * min(max_seqs - count, num_tokens - q_len * count)
            out = np.zeros(1 + 2 * capacity, dtype=np.int32)
            assert write_prefill_tiles(np.array(q_lens, dtype=np.int64), block_m, capacity, out) <= capacity
