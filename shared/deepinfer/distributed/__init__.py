"""Tensor parallelism over torch.distributed: process groups, sharded layers and the multi-process executor.

NCCL on GPUs, gloo on the CPU. Rank 0 is the engine process; ranks 1..N-1 are spawned workers that hold the
other shards and replay the steps rank 0 broadcasts (see `deepinfer.distributed.executor`).
"""

from deepinfer.distributed.parallel_state import (
    TensorParallelGroup,
    get_tp_group,
    get_tp_rank,
    get_tp_world_size,
    init_tensor_parallel,
)

__all__ = [
    "TensorParallelGroup",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_world_size",
    "init_tensor_parallel",
]
