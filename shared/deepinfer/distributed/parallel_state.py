"""The tensor-parallel process group: set up once per process, then passed down explicitly.

torch.distributed keeps the process-wide group state itself; this module holds none. `init_tensor_parallel`
returns a `TensorParallelGroup` that layers receive as an argument; `get_tp_group()` rebuilds the same view
from torch.distributed for code that was not handed one.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")

#: How long a collective may wait for a peer before the process fails (a crashed rank, a stuck step).
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class TensorParallelGroup:
    """One rank's view of its tensor-parallel group; `world_size == 1` means no parallelism (no collectives)."""

    rank: int = 0
    world_size: int = 1
    #: torch ProcessGroup; None when world_size == 1.
    group: Any = None
    #: Where collective buffers live: cuda:<local rank> with NCCL, cpu with gloo.
    device: torch.device = torch.device("cpu")

    @property
    def is_driver(self) -> bool:
        """True on rank 0, the engine process that schedules and samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place and return it."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` (same shape on all ranks) along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `x` on every rank with rank `src`'s `x` (in place) and return it."""
        if self.world_size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x


#: The group of an engine that runs in one process.
SINGLE_RANK = TensorParallelGroup()


def free_tcp_init_method(host: str = "127.0.0.1") -> str:
    """A `tcp://host:port` init method on a port that was free a moment ago (for tests and local runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def default_backend(device: torch.device | str) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tensor_parallel(
    tp_size: int,
    rank: int,
    backend: str = "gloo",
    init_method: str | None = None,
    *,
    device: torch.device | str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TensorParallelGroup:
    """Join this process to a group of `tp_size` ranks as `rank` and return its view.

    `init_method`: "tcp://127.0.0.1:<port>" or "file://<path>" shared by all ranks (None = env://).
    `device`: where collective buffers live (default cuda:<rank> with NCCL, cpu with gloo).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside a group of tp_size={tp_size}")
    if device is None:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    device = torch.device(device)
    if tp_size == 1:
        return TensorParallelGroup(device=device)
    if backend == "nccl":
        # NCCL reads its settings from the environment when it starts; NVLink multicast (NVLS) stays off on
        # every host we run on (see the issue tracker, #7), and this is the process that starts NCCL. The same
        # for torch's symmetric memory and NVSHMEM, should a collective reach for them.
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
        torch.cuda.set_device(device)
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=tp_size, timeout=timedelta(seconds=timeout_s)
    )
    return TensorParallelGroup(rank=rank, world_size=tp_size, group=dist.group.WORLD, device=device)


def get_tp_group() -> TensorParallelGroup:
    """This process's group as torch.distributed knows it; the single-rank group when none was set up."""
    if not dist.is_available() or not dist.is_initialized():
        return SINGLE_RANK
    backend = dist.get_backend()
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return TensorParallelGroup(rank=rank, world_size=dist.get_world_size(), group=dist.group.WORLD, device=device)


def get_tp_rank() -> int:
    """This process's rank in its tensor-parallel group (0 without one)."""
    return get_tp_group().rank


def get_tp_world_size() -> int:
    """Ranks in this process's tensor-parallel group (1 without one)."""
    return get_tp_group().world_size


def destroy_tensor_parallel() -> None:
    """Leave the process group (no-op when none was set up)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
