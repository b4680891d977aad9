"""Tensor-parallel primitives over torch.distributed: the process group, parallel layers, shard arithmetic and
sharded weight loading. Models build on them; they know no model, loader or engine.

NCCL on GPUs, gloo on the CPU. The processes that run them are spawned by `deepinfer.executor`.
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
