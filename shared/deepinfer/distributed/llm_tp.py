"""`LLM(..., tensor_parallel_size=N)` until EngineArgs/EngineCore carry the field themselves.

`start_tensor_parallel` is the one call EngineCore needs: it spawns the workers, loads rank 0's shard and
returns the driver (the model the runner calls) with the rank's geometry (the KV cache's head count).
`TensorParallelEngineCore` / `TensorParallelLLM` wire it now without touching engine/args.py, core.py or
llm.py; once those take `tensor_parallel_size` (docs/tensor-parallel.md, "Wiring"), delete both classes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.distributed.executor import TensorParallelDriver, WorkerSpec, spawn_tensor_parallel
from deepinfer.distributed.parallel_state import default_backend, free_tcp_init_method
from deepinfer.distributed.sharding import shard_config
from deepinfer.engine.args import EngineArgs
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.core import EngineCore
from deepinfer.engine.llm import LLM
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kernels import KernelOps, get_ops, resolve_accelerator
from deepinfer.kvcache.hashing import model_fingerprint
from deepinfer.loader.hf import load_generation_config, load_model_config
from deepinfer.model_store import default_cache_dir, resolve_model
from deepinfer.models.config import ModelConfig
from deepinfer.sampling.params import SamplingParams
from deepinfer.tokenizer import Tokenizer


@dataclass(kw_only=True)
class TensorParallelEngineArgs(EngineArgs):
    """EngineArgs plus the tensor-parallel size (moves into EngineArgs once args.py is free)."""

    #: Processes (one per GPU, or CPU processes over gloo) that each hold 1/N of every layer.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


def start_tensor_parallel(
    args: Any, model_dir: Path, dtype: torch.dtype, device: torch.device, ops: KernelOps
) -> tuple[TensorParallelDriver, ModelConfig]:
    """Rank 0's model (the driver over the spawned workers) and this rank's ModelConfig view (its heads, KV
    heads and MLP columns), for `args.tensor_parallel_size` > 1; ValueError for what TP does not support yet."""
    tp_size = args.tensor_parallel_size
    if getattr(args, "batch_invariant", False):
        raise ValueError("batch_invariant is not supported with tensor_parallel_size > 1 yet")
    if device.type == "cuda":
        if not args.enforce_eager:
            raise ValueError("tensor_parallel_size > 1 needs enforce_eager=True (no CUDA graphs across ranks yet)")
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


class TensorParallelEngineCore(EngineCore):
    """EngineCore whose model is a tensor-parallel group (bridge: EngineCore.__init__ with the model loading
    replaced by `start_tensor_parallel`; `close()` stops the workers)."""

    def __init__(self, args: TensorParallelEngineArgs) -> None:
        self.args = args
        self.model_dir = resolve_model(args.model, args.cache_dir or default_cache_dir(), progress=args.progress)
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir) if (self.model_dir / "tokenizer.json").is_file() else None
        self.generation_config = load_generation_config(self.model_dir)
        self.device = args.resolve_device()
        self.dtype = args.resolve_dtype(self.device)
        self.ops = get_ops(resolve_accelerator(args.accelerator, self.device))
        self.driver, self.model_config = start_tensor_parallel(args, self.model_dir, self.dtype, self.device, self.ops)
        self.max_model_len = self._max_model_len()
        self.kv_plan = self._plan_kv_cache(self.driver)
        eos = self.generation_config.get("eos_token_id")
        eos_ids = (eos if isinstance(eos, list) else [eos]) if eos is not None else []
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) if self.tokenizer is not None else (
            {int(t) for t in eos_ids} | set(self.model_config.eos_token_ids)
        )
        self.fingerprint = model_fingerprint(self.model_dir, args.model_revision)
        self.scheduler = Scheduler(
            EngineConfig(
                num_blocks=self.kv_plan.num_blocks,
                max_model_len=self.max_model_len,
                block_size=args.block_size,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=args.enable_prefix_caching,
                model_fingerprint=self.fingerprint,
                enable_kv_events=args.enable_kv_events,
            )
        )
        self.runner = ModelRunner(
            self.driver,
            self._allocate_kv_caches(),
            block_size=args.block_size,
            vocab_size=self.model_config.vocab_size,
            device=self.device,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            max_num_seqs=args.max_num_seqs,
            use_cuda_graphs=False,
        )

    def close(self) -> None:
        """Stop the worker processes and leave the process group."""
        self.driver.close()


class TensorParallelLLM(LLM):
    """`LLM` with `tensor_parallel_size`; use as a context manager or call `close()` to stop the workers
    (they also stop when this object is collected or the interpreter exits)."""

    def __init__(self, model: str | Path | None = None, *, tensor_parallel_size: int = 1, **engine_args: Any):
        args = TensorParallelEngineArgs(model=model, tensor_parallel_size=tensor_parallel_size, **engine_args)
        self.engine = TensorParallelEngineCore(args) if tensor_parallel_size > 1 else EngineCore(args)
        self.tokenizer = self.engine.tokenizer
        self.default_sampling_params = SamplingParams.from_generation_config(self.engine.generation_config)
        self._request_counter = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel workers (no-op at tensor_parallel_size 1)."""
        if isinstance(self.engine, TensorParallelEngineCore):
            self.engine.close()

    def __enter__(self) -> TensorParallelLLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
