"""CUDA graphs for decode-only steps: the model forward captured once per (batch size, context bucket), replayed.

A decode step of B requests whose longest context is L runs the graph captured for the smallest size >= B on the
ladder 1, 2, 4, 8, 16, 24, 32, ... (multiples of 8 up to max_num_seqs, as vLLM) and the smallest context
bucket >= L; the batch is padded up to it. Buckets are multiples of the decode kernel's split-K partition
(512 keys): 1, 2, 4, 8, ... partitions up to max_model_len, so the grid of a step at 2k context has 4-8
partitions instead of max_model_len / 512 (16 at 8k), most of which would exit at once.
Every graph reads its inputs from one set of static device buffers, filled before each replay by one
non_blocking copy per dtype from pinned host buffers of the same layout (`GraphInputs`):

    int64 [6, max_bs]                       input_ids | positions | slot_mapping | async scheduling's indices:
                                            placeholder rows of input_ids | their block-table rows | sampled rows
    int32 [max_bs_aligned + max_bs * W]     seq_lens  | block_tables (row-major, W = max blocks per sequence)
    int32 [max_bs + 1]                      query_start_loc = 0, 1, 2, ... (fixed: one token per row)

With `logits` given (the model's compute_logits), each graph also computes the step's float32 logits into one
static [max_bs, V] buffer that every graph writes (the eager sampler reads it when a row samples at random), and
each row's greedy token with its raw logprob (`sampling.sampler.greedy_tokens`): an all-greedy step without
penalties or bias needs no sampler launch and no metadata upload, and no step launches the LM head itself.

The attention metadata is captured with max_seq_len = the bucket, so the split-K grid (and its partition
buffers) is fixed per graph; partitions past a sequence's end exit at once. Batch-invariant mode captures
only the max_model_len bucket, so a sequence's partitions never depend on the other sequences.
Padding rows write no KV (slot -1) and attend to one key of the reserved null block 0 (seq_len 1).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.sampling.sampler import greedy_tokens

if TYPE_CHECKING:
    from deepinfer.engine.inputs import BlockTable, HostBatch

logger = logging.getLogger(__name__)

_ALIGN = 16
#: Keys per split-K partition of the decode attention kernel (its default partition_size).
DECODE_PARTITION_SIZE = 512


#: Step shapes whose buffer slices a CudaGraphRunner keeps (bs x placeholders x sampled; cleared when full).
_MAX_CACHED_VIEWS = 1024
#: Rows of the int64 static buffer: the graph's three inputs, then the async step's three index lists.
_NUM_INT64_ROWS = 6


class GraphStep(NamedTuple):
    """What a decode graph's replay leaves on the device, [bs] rows (padding rows last)."""

    hidden: torch.Tensor  # [bs, hidden]
    logits: torch.Tensor | None  # [bs, V] float32, a view of the static buffer every graph writes (None: no logits)
    greedy_token_ids: torch.Tensor | None  # [bs] int64: each row's argmax
    greedy_logprobs: torch.Tensor | None  # [bs] float32: its raw logprob


class StagedIndices(NamedTuple):
    """Async scheduling's index lists of a graph step, on the device (views of the static int64 buffer)."""

    placeholder_indices: torch.Tensor  # [P] rows of input_ids fed a placeholder
    placeholder_rows: torch.Tensor  # [P] the block-table row each one's token was sampled into
    sampled_rows: torch.Tensor  # [S] the block-table row of each sampled request


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def seq_len_buckets(max_model_len: int, fixed: bool = False) -> list[int]:
    """Context buckets: 1, 2, 4, ... decode partitions of 512 keys, capped by (and ending at) max_model_len;
    only [max_model_len] when `fixed` (batch-invariant mode)."""
    buckets, num_partitions = [], 1
    while not fixed and num_partitions * DECODE_PARTITION_SIZE < max_model_len:
        buckets.append(num_partitions * DECODE_PARTITION_SIZE)
        num_partitions *= 2
    return [*buckets, max_model_len]


def padded_batch_size(sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest captured size that holds num_seqs rows; None when none does."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


class GraphInputs:
    """Host side of the static graph inputs (pinned on CUDA): a decode batch padded to a captured size."""

    def __init__(self, max_bs: int, width: int, pinned: bool = False) -> None:
        self.max_bs, self.width = max_bs, width
        self.seq_off = -(-max_bs // _ALIGN) * _ALIGN  # block_tables start in the int32 buffer
        self.host64 = torch.zeros(_NUM_INT64_ROWS, max_bs, dtype=torch.int64, pin_memory=pinned)
        self.host32 = torch.zeros(self.seq_off + max_bs * width, dtype=torch.int32, pin_memory=pinned)
        self._h64: np.ndarray = self.host64.numpy()
        self._h32: np.ndarray = self.host32.numpy()

    def fill(self, batch: HostBatch, block_table: BlockTable, bs: int) -> int:
        """Write `batch` padded to `bs` rows; the int32 elements to copy (the int64 buffer goes whole)."""
        from deepinfer.engine.inputs import NULL_ROW

        num_seqs, h64, h32 = batch.num_seqs, self._h64, self._h32
        assert batch.is_decode_only and num_seqs <= bs <= self.max_bs, (batch.num_tokens, num_seqs, bs)
        h64[0, :num_seqs] = batch.input_ids
        h64[1, :num_seqs] = batch.positions
        h64[2, :num_seqs] = batch.slot_mapping
        h64[:2, num_seqs:bs] = 0  # padding rows: token 0 at position 0 ...
        h64[2, num_seqs:bs] = -1  # ... writing no KV
        if batch.placeholder_indices:
            num_placeholders = len(batch.placeholder_indices)
            h64[3, :num_placeholders] = batch.placeholder_indices
            h64[4, :num_placeholders] = batch.placeholder_rows
        h64[5, : len(batch.sampled_rows)] = batch.sampled_rows
        h32[:num_seqs] = batch.seq_lens
        h32[num_seqs:bs] = 1  # ... attending to one key of the null block
        n32 = self.seq_off + bs * self.width
        rows = batch.block_table_rows + [NULL_ROW] * (bs - num_seqs)
        # Only the live columns: entries past a row's blocks are never read, whatever stale value they hold.
        width = max(1, batch.max_num_blocks)
        assert width <= self.width, (width, self.width)
        tables = h32[self.seq_off : n32].reshape(bs, self.width)
        block_table.gather(rows, width, tables[:, :width] if width < self.width else tables)
        return n32


class CudaGraphRunner:
    """Captures the model forward (and the logits) for decode batches and replays it: a GraphStep of [bs] rows."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        *,
        batch_invariant: bool = False,
        capture_context: contextlib.AbstractContextManager | None = None,
        logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        #: hidden [N, hidden] -> float32 logits [N, V], captured after the forward (None: the graphs end there).
        self.compute_logits = logits
        #: The static logits every graph writes ([max_bs, V]; allocated by the first warm-up, outside the pool).
        self.logits: torch.Tensor | None = None
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        self.seq_len_buckets = seq_len_buckets(max_model_len, fixed=batch_invariant)
        self.max_bs = self.sizes[-1]
        self.width = -(-max_model_len // block_size)  # block-table columns: max blocks of one sequence
        self.inputs = GraphInputs(self.max_bs, self.width, pinned=True)
        self.static64 = torch.zeros(_NUM_INT64_ROWS, self.max_bs, dtype=torch.int64, device=device)
        self.static32 = torch.zeros(self.inputs.host32.numel(), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(self.max_bs + 1, dtype=torch.int32, device=device)
        #: (batch size, context bucket) -> graph and its output
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], GraphStep] = {}
        #: Replays so far (decode steps that ran as a graph).
        self.num_replays = 0
        self._copied = torch.cuda.Event()
        #: (bs, placeholders, sampled rows) -> the step's slices of the static buffers (see _views).
        self._step_views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, StagedIndices]] = {}
        self._capture_context = capture_context or contextlib.nullcontext()
        #: The graphs' memory pool once captured (the piecewise graphs capture into it too).
        self.pool: tuple[int, int] | None = None

    def can_run(self, batch: HostBatch) -> bool:
        """True for a decode-only batch that fits the largest captured size."""
        return bool(self.graphs) and batch.is_decode_only and 0 < batch.num_seqs <= self.max_bs

    def _metadata(self, bs: int, max_seq_len: int) -> AttentionMetadata:
        seq_off = self.inputs.seq_off
        tables = self.static32[seq_off : seq_off + bs * self.width].view(bs, self.width)
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.static32[:bs],
            block_tables=tables,
            slot_mapping=self.static64[2, :bs],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(bs + 1)),
            # Host seq_lens are read only by the torch twin, which never runs under a graph.
            seq_lens_cpu=[max_seq_len] * bs,
        )

    def _forward(self, bs: int, max_seq_len: int) -> torch.Tensor:
        meta = self._metadata(bs, max_seq_len)
        return self.model(self.static64[0, :bs], self.static64[1, :bs], self.kv_caches, meta)

    def _step(self, bs: int, max_seq_len: int) -> GraphStep:
        """The captured work: the forward, then (with compute_logits) the logits and the greedy tokens."""
        hidden = self._forward(bs, max_seq_len)
        if self.compute_logits is None:
            return GraphStep(hidden, None, None, None)
        logits = self.compute_logits(hidden)
        if self.logits is None:  # the first warm-up (outside capture): the one buffer for every graph
            self.logits = torch.empty(self.max_bs, logits.shape[1], dtype=logits.dtype, device=logits.device)
        static = self.logits[:bs]
        static.copy_(logits)
        return GraphStep(hidden, static, *greedy_tokens(static))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, bucket), largest first, into one shared memory pool (inputs = padding rows)."""
        self.static64[2].fill_(-1)
        self.static32[: self.max_bs].fill_(1)
        self.static32[self.inputs.seq_off :].zero_()
        pool = self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.static64.device)
        started = time.perf_counter()
        logger.info("capturing decode CUDA graphs: %d batch sizes (1..%d) x %d context buckets (..%d)",
                    len(self.sizes), self.max_bs, len(self.seq_len_buckets), self.seq_len_buckets[-1])
        with self._capture_context:
            for bs in reversed(self.sizes):
                for max_seq_len in reversed(self.seq_len_buckets):
                    # Warm-up off the capture: Triton compiles its specialisations and cuBLAS picks kernels here.
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        self._step(bs, max_seq_len)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self.outputs[bs, max_seq_len] = self._step(bs, max_seq_len)
                    self.graphs[bs, max_seq_len] = graph
        torch.cuda.synchronize()
        logger.info("decode CUDA graphs: %d captured in %.1f s", len(self.graphs), time.perf_counter() - started)

    def bucket(self, max_seq_len: int) -> int:
        """The smallest captured context bucket that holds max_seq_len."""
        return next((b for b in self.seq_len_buckets if b >= max_seq_len), self.seq_len_buckets[-1])

    def _views(
        self, bs: int, num_placeholders: int, num_sampled: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StagedIndices]:
        """(device int32 part to copy, its host twin, input ids [bs], the index lists) of a step of this shape:
        sliced once per shape, not every step (each slice is a torch call)."""
        key = (bs, num_placeholders, num_sampled)
        views = self._step_views.get(key)
        if views is None:
            if len(self._step_views) >= _MAX_CACHED_VIEWS:
                self._step_views.clear()
            n32, s64 = self.inputs.seq_off + bs * self.width, self.static64
            indices = StagedIndices(s64[3, :num_placeholders], s64[4, :num_placeholders], s64[5, :num_sampled])
            views = self._step_views[key] = (self.static32[:n32], self.inputs.host32[:n32], s64[0, :bs], indices)
        return views

    def run(
        self,
        batch: HostBatch,
        block_table: BlockTable,
        before_replay: Callable[[torch.Tensor, StagedIndices], None] | None = None,
    ) -> GraphStep:
        """Fill the static buffers from `batch` (padded to its captured size) and replay: its GraphStep ([bs] rows).

        `before_replay(input_ids, indices)` runs on the static input ids [bs] after the copy (device-side fills),
        with the batch's placeholder and sampled rows, which came in the same copy.
        """
        bs = padded_batch_size(self.sizes, batch.num_seqs)
        assert bs is not None and batch.is_decode_only, (batch.num_seqs, batch.num_tokens)
        key = (bs, self.bucket(max(batch.seq_lens)))
        self._copied.synchronize()  # the previous replay's copy has left the pinned buffers
        static32, host32, input_ids, indices = self._views(bs, len(batch.placeholder_indices), len(batch.sampled_rows))
        self.inputs.fill(batch, block_table, bs)
        self.static64.copy_(self.inputs.host64, non_blocking=True)
        static32.copy_(host32, non_blocking=True)
        self._copied.record()
        if before_replay is not None:
            before_replay(input_ids, indices)
        self.graphs[key].replay()
        self.num_replays += 1
        return self.outputs[key]
