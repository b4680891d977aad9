"""Multi-process tensor-parallel execution: rank 0 is the engine, ranks 1..N-1 replay its steps.

Rank 0 runs the usual engine (scheduler, runner, sampler) over a `TensorParallelDriver`, which looks like a
model to the runner. Before each collective step the driver broadcasts what the workers need, so every rank
calls the same collectives in the same order:

    rank 0 (driver)                               ranks 1..N-1 (serve_steps)
    forward:  header [FORWARD, T, B, W, ...]  ─▶  allocate the KV shard once, unpack the step
              payload int64 [T|T|T|B+1|B|B·W] ─▶  input_ids | positions | slot_mapping | query_start_loc |
                                                  seq_lens | block_tables
              shard forward (2 all-reduces/layer)  shard forward (the same collectives)
    logits:   header [LOGITS, N, ...], hidden  ─▶  shard logits; all-gather over the vocabulary
    close:    header [SHUTDOWN]                ─▶  leave the group, exit

Only rank 0 samples. Workers allocate their KV shard ([2, num_blocks, block_size, Hkv / tp, D] per layer)
at the first step, with rank 0's num_blocks and block_size.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from deepinfer.distributed.parallel_state import (
    DEFAULT_TIMEOUT_S,
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from deepinfer.kernels import AttentionMetadata, get_ops
from deepinfer.loader.shard import load_model_shard
from deepinfer.models.parallel import shard_config

logger = logging.getLogger(__name__)

_FORWARD, _LOGITS, _SHUTDOWN = 1, 2, 3
_HEADER_LEN = 8  # [command, T, B, W, max_query_len, max_seq_len, num_blocks, block_size] / [LOGITS, N, 0...]


@dataclass(frozen=True)
class WorkerSpec:
    """How a worker builds its shard and joins the group (pickled into the spawned process)."""

    model_dir: str
    dtype: torch.dtype
    device_type: str  # "cpu" | "cuda"
    accelerator: str
    tp_size: int
    backend: str
    init_method: str
    load_format: str = "auto"
    dummy_seed: int = 0
    #: Rank r runs on cuda:(first_device_index + r).
    first_device_index: int = 0
    num_threads: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S

    def device(self, rank: int) -> torch.device:
        """The device of `rank`."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.first_device_index + rank)


# -- the step broadcast -----------------------------------------------------------------------------------------
def _send_header(tp: TensorParallelGroup, values: list[int]) -> None:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[: len(values)] = torch.tensor(values, dtype=torch.int64)
    tp.broadcast(header.to(tp.device))


def broadcast_forward(
    tp: TensorParallelGroup,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
) -> None:
    """Rank 0: send one forward's flattened inputs and the KV cache geometry to the workers."""
    num_tokens, (num_seqs, width) = input_ids.numel(), meta.block_tables.shape
    _, num_blocks, block_size = kv_caches[0].shape[:3]
    _send_header(
        tp, [_FORWARD, num_tokens, num_seqs, width, meta.max_query_len, meta.max_seq_len, num_blocks, block_size]
    )
    parts = (input_ids, positions, meta.slot_mapping[:num_tokens], meta.query_start_loc, meta.seq_lens,
             meta.block_tables.reshape(-1))
    tp.broadcast(torch.cat([p.to(device=tp.device, dtype=torch.int64) for p in parts]))


def _receive_forward(
    tp: TensorParallelGroup, header: list[int]
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    _, num_tokens, num_seqs, width, max_query_len, max_seq_len = header[:6]
    payload = torch.empty(3 * num_tokens + 2 * num_seqs + 1 + num_seqs * width, dtype=torch.int64, device=tp.device)
    tp.broadcast(payload)
    input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables = payload.split(
        [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width]
    )
    starts = query_start_loc.tolist()
    meta = AttentionMetadata(
        query_start_loc=query_start_loc.int(),
        seq_lens=seq_lens.int(),
        block_tables=block_tables.int().view(num_seqs, width),
        slot_mapping=slot_mapping,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens.tolist(),
        num_decodes=sum(1 for a, b in itertools.pairwise(starts) if b - a == 1),
    )
    return input_ids, positions, meta


@torch.inference_mode()
def serve_steps(model: nn.Module, tp: TensorParallelGroup, dtype: torch.dtype) -> int:
    """Worker loop: replay rank 0's forwards and logits until it says shutdown; returns the steps served."""
    rank_config = shard_config(model.config, tp.world_size, tp.rank)
    kv_caches: list[torch.Tensor] = []
    header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=tp.device)
    num_steps = 0
    while True:
        values = tp.broadcast(header).tolist()
        command = values[0]
        if command == _SHUTDOWN:
            return num_steps
        if command == _FORWARD:
            input_ids, positions, meta = _receive_forward(tp, values)
            shape = rank_config.kv_cache_shape(values[6], values[7])
            if not kv_caches or tuple(kv_caches[0].shape) != shape:
                kv_caches = [torch.zeros(shape, dtype=dtype, device=tp.device) for _ in range(len(model.model.layers))]
            model(input_ids, positions, kv_caches, meta)
            num_steps += 1
        elif command == _LOGITS:
            hidden = torch.empty(values[1], model.config.hidden_size, dtype=dtype, device=tp.device)
            model.compute_logits(tp.broadcast(hidden))
        else:
            raise RuntimeError(f"unknown step command {command} from rank 0")


# -- rank 0 -----------------------------------------------------------------------------------------------------
class TensorParallelDriver(nn.Module):
    """Rank 0's model: its own shard, plus the broadcast that makes the workers run the same step.

    Lifecycle: built by `start_tensor_parallel` (workers spawned and loaded); forward / compute_logits as any
    model; `close()` (or garbage collection, or interpreter exit) stops the workers and leaves the group.
    """

    def __init__(self, model: nn.Module, tp: TensorParallelGroup, processes: list, timeout_s: float) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.tp = tp
        self.processes = processes
        self._finalizer = weakref.finalize(self, _shutdown, tp, processes, timeout_s)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Broadcast the step, then run rank 0's shard: [T] ids/positions -> hidden [T, hidden]."""
        broadcast_forward(self.tp, input_ids, positions, kv_caches, meta)
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32, gathered from every rank's vocabulary slice."""
        _send_header(self.tp, [_LOGITS, hidden.shape[0]])
        return self.model.compute_logits(self.tp.broadcast(hidden.contiguous()))

    def rebuild_buffers(self) -> None:
        """Rank 0's shard recomputes its non-persistent buffers."""
        self.model.rebuild_buffers()

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        self._finalizer()


def _shutdown(tp: TensorParallelGroup, processes: list, timeout_s: float) -> None:
    try:
        _send_header(tp, [_SHUTDOWN])
    except Exception:  # a worker already gone: still reap the others
        logger.exception("tensor-parallel shutdown broadcast failed")
    deadline = time.monotonic() + min(timeout_s, 30.0)
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(5.0)
    destroy_tensor_parallel()


def _worker_main(rank: int, spec: WorkerSpec, ready: mp.Queue) -> None:
    """Entry point of worker `rank` (a spawned process)."""
    torch.set_num_threads(spec.num_threads)
    try:
        device = spec.device(rank)
        tp = init_tensor_parallel(
            spec.tp_size, rank, spec.backend, spec.init_method, device=device, timeout_s=spec.timeout_s
        )
        model = load_model_shard(
            spec.model_dir, spec.dtype, device, get_ops(spec.accelerator), tp,
            load_format=spec.load_format, dummy_seed=spec.dummy_seed,
        )
    except BaseException as exc:
        ready.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    ready.put((rank, None))
    try:
        serve_steps(model, tp, spec.dtype)
    finally:
        destroy_tensor_parallel()


def _await_workers(processes: list, ready: mp.Queue, timeout_s: float) -> None:
    """Wait until every worker loaded its shard; RuntimeError naming the first that failed or died."""
    pending = {rank for rank in range(1, len(processes) + 1)}
    deadline = time.monotonic() + timeout_s
    while pending:
        try:
            rank, error = ready.get(timeout=0.5)
        except queue.Empty:
            dead = [r for r in pending if not processes[r - 1].is_alive()]
            if dead:
                raise RuntimeError(_died_message(dead[0], processes[dead[0] - 1], ready, "while loading")) from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers {sorted(pending)} not ready after {timeout_s} s") from None
            continue
        if error is not None:
            raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start: {error}")
        pending.discard(rank)


def _join_group_watching(spec: WorkerSpec, device: torch.device, processes: list, ready: mp.Queue):
    """Rank 0 joins the group, which blocks until every rank has joined, while watching the spawned ranks: one
    that dies first (it could not re-import the main module, a bad device) ends the wait within a second with
    its exit code and error, instead of after the group's timeout. The abandoned join thread is a daemon."""
    outcome: dict[str, object] = {}

    def join() -> None:
        try:
            outcome["tp"] = init_tensor_parallel(
                spec.tp_size, 0, spec.backend, spec.init_method, device=device, timeout_s=spec.timeout_s
            )
        except BaseException as exc:  # re-raised on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=join, name="deepinfer-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        dead = [rank for rank, process in enumerate(processes, 1) if not process.is_alive()]
        if dead and thread.is_alive():
            raise RuntimeError(_died_message(dead[0], processes[dead[0] - 1], ready, "before joining the group"))
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["tp"]


def _died_message(rank: int, process, ready: mp.Queue, when: str) -> str:
    """Why rank `rank` is gone: the error it reported, else its exit code (its traceback is on stderr)."""
    try:
        _, error = ready.get(timeout=0.5)  # before every rank has joined, a message can only be an error
    except queue.Empty:
        error = None
    detail = error or "no error reported: see its traceback above (e.g. the main module could not be re-imported)"
    return f"tensor-parallel worker rank {rank} exited with code {process.exitcode} {when}: {detail}"


def spawn_tensor_parallel(
    spec: WorkerSpec, ops, *, progress: bool = False
) -> TensorParallelDriver:
    """Spawn ranks 1..N-1, join the group as rank 0, load rank 0's shard, wait for the workers' shards."""
    context = mp.get_context("spawn")
    ready = context.Queue()
    processes = [
        context.Process(target=_worker_main, args=(rank, spec, ready), name=f"deepinfer-tp{rank}", daemon=True)
        for rank in range(1, spec.tp_size)
    ]
    for process in processes:
        process.start()
    tp = None
    try:
        device = spec.device(0)
        tp = _join_group_watching(spec, device, processes, ready)
        model = load_model_shard(
            Path(spec.model_dir), spec.dtype, device, ops, tp,
            load_format=spec.load_format, dummy_seed=spec.dummy_seed, progress=progress,
        )
        _await_workers(processes, ready, spec.timeout_s)
    except BaseException:
        for process in processes:
            process.terminate()
            process.join(5.0)
        if tp is not None:
            destroy_tensor_parallel()
        raise
    return TensorParallelDriver(model, tp, processes, spec.timeout_s)
