"""Start a tensor-parallel model group for an engine: spawn ranks 1..N-1, load rank 0's shard, return the driver.

`EngineCore` calls `start_tensor_parallel` when `EngineArgs.tensor_parallel_size > 1`; the driver is the model the
runner calls, and the returned ModelConfig is rank 0's view (its heads, KV heads, MLP columns) for KV sizing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer.distributed.parallel_state import default_backend, free_tcp_init_method
from deepinfer.executor.tensor_parallel import TensorParallelDriver, WorkerSpec, spawn_tensor_parallel
from deepinfer.kernels import KernelOps
from deepinfer.loader.hf import load_model_config
from deepinfer.models.config import ModelConfig
from deepinfer.models.parallel import shard_config


def start_tensor_parallel(
    args: Any, model_dir: Path, dtype: torch.dtype, device: torch.device, ops: KernelOps
) -> tuple[TensorParallelDriver, ModelConfig]:
    """Rank 0's model (the driver over the spawned workers) and this rank's ModelConfig view (its heads, KV
    heads and MLP columns), for `args.tensor_parallel_size` > 1; ValueError for what TP does not support yet."""
    tp_size = args.tensor_parallel_size
    if getattr(args, "batch_invariant", False):
        raise ValueError("batch_invariant is not supported with tensor_parallel_size > 1 yet")
    if device.type == "cuda":  # eager (EngineArgs.resolve_execution_mode): no CUDA graphs across ranks yet
        first = device.index or 0
        if torch.cuda.device_count() < first + tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} from cuda:{first} needs {first + tp_size} GPUs, "
                f"found {torch.cuda.device_count()}"
            )
    elif device.type != "cpu":
        raise ValueError(f"tensor_parallel_size > 1 runs on cuda or cpu, not {device.type}")
    config = load_model_config(model_dir)
    spec = WorkerSpec(
        model_dir=str(model_dir),
        dtype=dtype,
        device_type=device.type,
        accelerator=ops.accelerator,
        tp_size=tp_size,
        backend=default_backend(device),
        init_method=free_tcp_init_method(),
        load_format=args.load_format,
        dummy_seed=args.dummy_seed,
        first_device_index=device.index or 0,
        num_threads=torch.get_num_threads(),
    )
    driver = spawn_tensor_parallel(spec, ops, progress=args.progress)
    return driver, shard_config(config, tp_size, 0)
