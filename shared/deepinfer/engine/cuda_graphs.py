"""CUDA graphs for decode-only steps: the model forward captured once per batch size, replayed every step.

A decode step of B requests runs the graph captured for the smallest size >= B on the ladder
1, 2, 4, 8, 16, 24, 32, ... (multiples of 8 up to max_num_seqs, as vLLM); the batch is padded up to it.
Every graph reads its inputs from one set of static device buffers, filled before each replay by one
non_blocking copy per dtype from pinned host buffers of the same layout:

    int64 [3, max_bs]                       input_ids | positions | slot_mapping
    int32 [max_bs_aligned + max_bs * W]     seq_lens  | block_tables (row-major, W = max blocks per sequence)
    int32 [max_bs + 1]                      query_start_loc = 0, 1, 2, ... (fixed: one token per row)

The attention metadata is captured with max_seq_len = max_model_len, so the split-K decode kernel's grid
(and its partition buffers) never depend on the batch; partitions past a sequence's end exit at once.
Padding rows write no KV (slot -1) and attend to one key of the reserved null block 0 (seq_len 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from deepinfer.engine.runner import HostBatch

_ALIGN = 16


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def padded_batch_size(sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest captured size that holds num_seqs rows; None when none does."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


class CudaGraphRunner:
    """Captures the model forward for decode batches and replays it; the hidden states come back [bs, hidden]."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.width = -(-max_model_len // block_size)  # block-table columns: max blocks of one sequence
        self._seq_off = -(-self.max_bs // _ALIGN) * _ALIGN  # block_tables start in the int32 buffer
        n32 = self._seq_off + self.max_bs * self.width
        self.host64 = torch.zeros(3, self.max_bs, dtype=torch.int64, pin_memory=True)
        self.host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=True)
        self.static64 = torch.zeros(3, self.max_bs, dtype=torch.int64, device=device)
        self.static32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(self.max_bs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        #: Replays so far (decode steps that ran as a graph).
        self.num_replays = 0
        self._copied = torch.cuda.Event()

    def can_run(self, batch: HostBatch) -> bool:
        """True for a decode-only batch that fits the largest captured size."""
        return bool(self.graphs) and batch.is_decode_only and 0 < batch.num_seqs <= self.max_bs

    def _metadata(self, bs: int) -> AttentionMetadata:
        tables = self.static32[self._seq_off : self._seq_off + bs * self.width].view(bs, self.width)
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.static32[:bs],
            block_tables=tables,
            slot_mapping=self.static64[2, :bs],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(bs + 1)),
            # Host seq_lens are read only by the torch twin, which never runs under a graph.
            seq_lens_cpu=[self.max_model_len] * bs,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.static64[0, :bs], self.static64[1, :bs], self.kv_caches, self._metadata(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one shared memory pool (inputs = padding rows: no KV writes)."""
        self.static64[2].fill_(-1)
        self.static32[: self.max_bs].fill_(1)
        self.static32[self._seq_off :].zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.static64.device)
        for bs in reversed(self.sizes):
            # Warm-up off the capture: Triton compiles its specialisations and cuBLAS picks its kernels here.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def run(self, batch: HostBatch) -> torch.Tensor:
        """Fill the static buffers from `batch` (padded to its captured size) and replay: hidden [bs, hidden]."""
        from deepinfer.engine.runner import pad_decode_batch, write_block_tables

        bs = padded_batch_size(self.sizes, batch.num_seqs)
        assert bs is not None and batch.is_decode_only, (batch.num_seqs, batch.num_tokens)
        batch = pad_decode_batch(batch, bs)
        self._copied.synchronize()  # the previous replay's copy has left the pinned buffers
        h64, h32 = self.host64.numpy(), self.host32.numpy()
        h64[0, :bs] = batch.input_ids
        h64[1, :bs] = batch.positions
        h64[2, :bs] = batch.slot_mapping
        h32[:bs] = batch.seq_lens
        n32 = self._seq_off + bs * self.width
        write_block_tables(h32[self._seq_off : n32].reshape(bs, self.width), batch.block_ids)
        self.static64.copy_(self.host64, non_blocking=True)
        self.static32[:n32].copy_(self.host32[:n32], non_blocking=True)
        self._copied.record()
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.outputs[bs]
