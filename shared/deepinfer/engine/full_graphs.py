"""Whole-forward CUDA graphs for steps with prompt rows (prefill and mixed prefill+decode), attention inside.

The piecewise graphs (piecewise_graphs) leave each layer's attention eager between L+1 replays: a mixed step of
a 1B model still launches 16 layers' attention from the host (recorded once a step, kernels' AttentionPlan), 17
replays, and each launch hands the GIL to a busy event loop. Here one graph per token bucket holds the whole
forward: its attention reads the step's layout from static buffers (graph mode,
kernels.triton_graph_attention), refilled before each replay:

    int32  query_start_loc [S_max+1] | seq_lens [S_max] | sampled rows [S_max] | prefill tiles [1 + 2 * capacity]
                                         one non_blocking copy from a pinned twin of the same layout
    int32  block_tables [S_max, W]       one device copy of the step's [B, w] (W: max_model_len's blocks)
    int64  input_ids, positions, slot_mapping [n]
                                         device copies of the step's, the padding rows' slots -1 (no KV write)

A step of T tokens over B sequences runs the smallest bucket n >= T (piecewise_graphs.token_buckets) with
S = min(max_num_seqs, n) sequence slots (B <= T <= n, B <= max_num_seqs): its B sequences, then empty slots
(no new row, seq_len 0). The graph ends at the hidden states of the step's sampled rows (the last row of each
sampling sequence, or a sequence's k + 1 last rows when it verifies k draft tokens, gathered by the static row list:
S slots, the unused ones row 0; a step with more rows to sample than S runs elsewhere), and with `logits` given
(the model's compute_logits) computes their float32 logits into the decode graphs' static buffer and each row's
greedy token with its raw logprob, as the decode graphs do (cuda_graphs): an all-greedy step without penalties,
bias or top logprobs launches no LM head and no sampler. The host work of a step is the tile list (numpy), those
copies and one replay. The graphs capture with every slot empty and no tile: the capture writes no KV.

Without CUDA (`use_graphs=False`) `run` runs the forward eagerly over the same static buffers (the torch twins
read the host lists, padded the same way): the padding and buffer logic is tested on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from deepinfer.engine.cuda_graphs import CudaGraphRunner, GraphStep
from deepinfer.engine.piecewise_graphs import (
    PiecewiseGraphRunner,
    capture_piecewise,
    smallest_bucket,
    supports_piecewise,
    token_buckets,
)
from deepinfer.kernels.metadata import AttentionMetadata
from deepinfer.kernels.triton_graph_attention import graph_block_m, prefill_tile_capacity, write_prefill_tiles
from deepinfer.sampling.sampler import greedy_tokens

logger = logging.getLogger(__name__)

_ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class GraphStepBuffers:
    """A graph-mode step's layout in static buffers (the module doc's int32 ones) and their pinned twin."""

    def __init__(self, max_seqs: int, width: int, max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_seqs = max_seqs
        self.block_m = graph_block_m(dtype)
        self.seq_off = _aligned(max_seqs + 1)
        self.rows_off = self.seq_off + _aligned(max_seqs)
        self.tile_off = self.rows_off + _aligned(max_seqs)
        size = self.tile_off + 1 + 2 * self.capacity(max_tokens)
        pinned = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pinned)
        self._h: np.ndarray = self.host.numpy()
        self.static = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, width, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event() if pinned else None

    def slots(self, num_tokens: int) -> int:
        """Sequence slots of a bucket of num_tokens rows."""
        return min(self.max_seqs, num_tokens)

    def capacity(self, num_tokens: int) -> int:
        """Prefill tiles a bucket of num_tokens rows holds."""
        return prefill_tile_capacity(num_tokens, self.slots(num_tokens), self.block_m)

    def metadata(self, n: int, slot_mapping: torch.Tensor, max_seq_len: int) -> AttentionMetadata:
        """Graph-mode metadata of bucket n over the static buffers. Its host lists hold only the bucket's size (the
        Triton path's checks read their ends); `with_host_lists` gives a step's for the torch twins."""
        slots, end = self.slots(n), self.tile_off + 1 + 2 * self.capacity(n)
        return AttentionMetadata(
            query_start_loc=self.static[: slots + 1], seq_lens=self.static[self.seq_off : self.seq_off + slots],
            block_tables=self.block_tables[:slots], slot_mapping=slot_mapping, max_query_len=n,
            max_seq_len=max_seq_len, query_start_loc_cpu=[0] * slots + [n], seq_lens_cpu=[0] * slots,
            prefill_tiles=self.static[self.tile_off : end],
        )

    def sampled_rows(self, n: int) -> torch.Tensor:
        """Bucket n's static list of the rows to sample [S] (int32; unused slots row 0)."""
        return self.static[self.rows_off : self.rows_off + self.slots(n)]

    def with_host_lists(self, meta: AttentionMetadata, n: int, step: AttentionMetadata) -> AttentionMetadata:
        """`meta` (bucket n's) with `step`'s host lists padded to the bucket's slots, as the buffers hold them."""
        pad = self.slots(n) - step.num_seqs
        total = step.query_start_loc_cpu[-1]
        return dataclasses.replace(meta, query_start_loc_cpu=[*step.query_start_loc_cpu, *[total] * pad],
                                   seq_lens_cpu=[*step.seq_lens_cpu, *[0] * pad])

    def fill(self, n: int, step: AttentionMetadata, sampled_rows: Sequence[int]) -> None:
        """Write `step`'s layout and its rows to sample for bucket n and copy them to the static buffers
        (non_blocking on CUDA)."""
        starts, num_seqs, slots, num_sampled = step.query_start_loc_cpu, step.num_seqs, self.slots(n), len(sampled_rows)
        assert num_sampled <= slots and num_seqs <= slots and starts[-1] <= n, (num_sampled, num_seqs, slots, starts[-1], n)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffer
        h, seq_off, capacity = self._h, self.seq_off, self.capacity(n)
        h[: num_seqs + 1] = starts
        h[num_seqs + 1 : slots + 1] = starts[-1]  # empty slots: no new row ...
        h[seq_off : seq_off + num_seqs] = step.seq_lens_cpu
        h[seq_off + num_seqs : seq_off + slots] = 0  # ... and no context
        h[self.rows_off : self.rows_off + num_sampled] = sampled_rows
        h[self.rows_off + num_sampled : self.rows_off + slots] = 0
        write_prefill_tiles(np.diff(h[: num_seqs + 1]), self.block_m, capacity, h[self.tile_off :])
        end = self.tile_off + 1 + 2 * capacity
        self.static[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        width = step.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(step.block_tables)


class FullGraphRunner:
    """Captures a Llama-family model's whole forward per token bucket, attention in graph mode (with `logits`, the
    sampled rows' logits and greedy tokens too), and runs steps with prompt rows through it: a GraphStep."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        *,
        use_graphs: bool = True,
        capture_context: contextlib.AbstractContextManager | None = None,
        logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
        logits_buffer: torch.Tensor | None = None,
    ) -> None:
        if not supports_piecewise(model):
            raise ValueError(f"{type(model).__name__} has no graph-mode attention (see supports_piecewise)")
        self.model, self.kv_caches, self.max_model_len = model, kv_caches, max_model_len
        #: hidden [N, hidden] -> float32 logits [N, V] (None: the graphs end at the sampled rows' hidden states),
        #: into `logits` ([>= max_num_seqs, V]; the decode graphs' when given, else allocated by the first warm-up).
        self.compute_logits, self.logits = logits, logits_buffer
        self.buckets = token_buckets(max_num_batched_tokens)
        self.use_graphs = use_graphs
        max_tokens = self.buckets[-1]
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)  # -1 = no KV write
        dtype = model.model.embed_tokens.weight.dtype
        self.attention = GraphStepBuffers(max_num_seqs, -(-max_model_len // block_size), max_tokens, dtype, device)
        #: bucket -> its graph-mode metadata, and (with graphs) its graph and the graph's output (S rows)
        self.metas = {n: self.attention.metadata(n, self.slot_mapping[:n], max_model_len) for n in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, GraphStep] = {}
        #: Steps run so far.
        self.num_runs = 0
        self._capture_context = capture_context or contextlib.nullcontext()

    @property
    def num_graphs(self) -> int:
        """Graphs captured (0 without graphs)."""
        return len(self.graphs)

    def can_run(self, num_tokens: int, num_sampled: int = 1) -> bool:
        """True once captured (or, without graphs, at once), for a step of 1..largest bucket tokens whose
        num_sampled rows to sample fit its bucket's slots (a step without drafts samples at most a row a sequence:
        always; one verifying drafts samples k + 1 rows a sequence)."""
        if not (bool(self.graphs) or not self.use_graphs) or not 0 < num_tokens <= self.buckets[-1]:
            return False
        return num_sampled <= self.attention.slots(smallest_bucket(self.buckets, num_tokens))

    def _step(self, n: int, meta: AttentionMetadata) -> GraphStep:
        """The captured work: the forward, the sampled rows' hidden states, then (with compute_logits) their logits
        and greedy tokens."""
        hidden = self.model(self.input_ids[:n], self.positions[:n], self.kv_caches, meta)
        hidden = hidden.index_select(0, self.attention.sampled_rows(n))
        if self.compute_logits is None:
            return GraphStep(hidden, None, None, None)
        logits = self.compute_logits(hidden)
        if self.logits is None:  # the first warm-up (outside capture): one buffer for every graph
            self.logits = torch.empty(self.attention.max_seqs, logits.shape[1], dtype=logits.dtype, device=logits.device)
        static = self.logits[: hidden.shape[0]]
        static.copy_(logits)
        return GraphStep(hidden, static, *greedy_tokens(static))

    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> None:
        """Capture every bucket's forward, largest first, into `pool` (a new one if None). Every slot is empty and
        no tile listed meanwhile, so attention reads no cache and nothing is written to it."""
        self.slot_mapping.fill_(-1)
        self.attention.static.zero_()
        device = self.slot_mapping.device
        free_before, started = torch.cuda.mem_get_info(device)[0], time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        logger.info("capturing full CUDA graphs of prompt steps: %d token buckets (%d..%d)", len(self.buckets),
                    self.buckets[0], self.buckets[-1])
        with self._capture_context:
            for n in reversed(self.buckets):
                # Warm-up off the capture: Triton compiles this bucket's specialisations and cuBLAS picks kernels here.
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._step(n, self.metas[n])
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[n] = self._step(n, self.metas[n])
                self.graphs[n] = graph
        torch.cuda.synchronize(device)
        logger.info("full CUDA graphs of prompt steps: %d captured in %.1f s, %.0f MiB", len(self.graphs),
                    time.perf_counter() - started, (free_before - torch.cuda.mem_get_info(device)[0]) / (1 << 20))

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, sampled_rows: Sequence[int]
    ) -> GraphStep:
        """The GraphStep of a step of T tokens (its device inputs and eager metadata, T within the largest bucket):
        the hidden states of `sampled_rows` (rows of the step, in the sampler's order), with compute_logits their
        logits and greedy tokens; the static buffers filled, padded to the bucket, and its graph replayed.

        The result views the graph's buffers: read it before the next run."""
        num_tokens, num_sampled = input_ids.shape[0], len(sampled_rows)
        n = smallest_bucket(self.buckets, num_tokens)
        assert n is not None and self.can_run(num_tokens), (num_tokens, self.buckets[-1])
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        if num_tokens < n:
            self.slot_mapping[num_tokens:n].fill_(-1)  # padding rows write no KV (ids and positions: any real ones)
        self.attention.fill(n, meta, sampled_rows)
        self.num_runs += 1
        if self.use_graphs:
            self.graphs[n].replay()
            step = self.outputs[n]
        else:
            with torch.inference_mode():
                step = self._step(n, self.attention.with_host_lists(self.metas[n], n, meta))
        return GraphStep(*(None if t is None else t[:num_sampled] for t in step))


def capture_full(
    model: torch.nn.Module, kv_caches: list[torch.Tensor], max_num_batched_tokens: int, max_num_seqs: int,
    max_model_len: int, block_size: int, device: torch.device, pool: tuple[int, int] | None = None,
    logits: Callable[[torch.Tensor], torch.Tensor] | None = None, logits_buffer: torch.Tensor | None = None,
) -> FullGraphRunner | None:
    """The captured full graphs of `model`'s prompt steps on CUDA, or None (logged) when it has no graph mode."""
    if not supports_piecewise(model):
        logger.info("full CUDA graphs of prompt steps off: %s is not a single-rank Llama-family model",
                    type(model).__name__)
        return None
    runner = FullGraphRunner(model, kv_caches, max_num_batched_tokens, max_num_seqs, max_model_len, block_size, device,
                             logits=logits, logits_buffer=logits_buffer)
    runner.capture(pool)
    return runner


def capture_prompt_graphs(
    model: torch.nn.Module, kv_caches: list[torch.Tensor], decode_graphs: CudaGraphRunner, max_num_batched_tokens: int,
    block_size: int, *, full: bool, sampling: bool = False,
) -> tuple[FullGraphRunner | None, PiecewiseGraphRunner | None]:
    """(full graphs, piecewise graphs) of `model`'s prompt steps, one or neither, in the decode graphs' pool (the full
    ones, with `sampling`, also with their logits tail when the decode graphs have one)."""
    graphs, device = decode_graphs, decode_graphs.static64.device
    if not full:
        return None, capture_piecewise(model, kv_caches, max_num_batched_tokens, device, graphs.pool)
    tail = sampling and graphs.compute_logits is not None
    return capture_full(model, kv_caches, max_num_batched_tokens, graphs.max_bs, graphs.max_model_len, block_size,
                        device, graphs.pool, graphs.compute_logits if tail else None,
                        graphs.logits if tail else None), None
