"""Defaults written once: a value that both a setting (`deepinfer.config`) and the code it configures carry lives
here, and both read it (the engine's are vLLM's names and values).

A `None` default is not repeated here: it means "unset", and the one place that resolves it is the code that
reads it (e.g. `EngineArgs.resolve_async_scheduling`, the engine's KV planning).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# -- the model: CommonSettings, EngineArgs, deepinfer.model_store -------------------------------------------------
#: What `deepinfer up`, the services and `LLM()` serve when no model is named (a GGUF shipped in a package).
DEFAULT_MODEL = "smollm2-135m-instruct"


def xdg_dir(variable: str, fallback: str, *parts: str, environ: Mapping[str, str] | None = None) -> Path:
    """An XDG base directory (e.g. $XDG_CACHE_HOME, else ~/.cache) joined with `parts`."""
    env = os.environ if environ is None else environ
    base = env.get(variable) or str(Path.home() / fallback)
    return Path(base).expanduser().joinpath(*parts)


def default_model_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where prepared models live: $XDG_CACHE_HOME/deepinfer/models (else ~/.cache/deepinfer/models)."""
    return xdg_dir("XDG_CACHE_HOME", ".cache", "deepinfer", "models", environ=environ)


# -- the engine: EngineArgs, EngineConfig, WorkerSettings (and CommonSettings.accelerator) ------------------------
#: "auto" = the GPU when there is one, else the CPU.
DEFAULT_DEVICE = "auto"
#: "auto" = bfloat16 on a device and on a CPU with bf16 instructions, else float32 (EngineArgs.resolve_dtype).
DEFAULT_DTYPE = "auto"
#: "auto" = the kernels of the device (deepinfer.kernels).
DEFAULT_ACCELERATOR = "auto"
#: Tokens per KV block (a power of two); block identity (hashes) depends on it.
DEFAULT_BLOCK_SIZE = 16
#: Most sequences in one batch.
DEFAULT_MAX_NUM_SEQS = 256
#: Most tokens computed in one step (decodes plus prefill chunks).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
#: Fraction of device memory the engine may use (weights + activations + KV).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
#: Reuse the KV blocks of identical prefixes.
DEFAULT_ENABLE_PREFIX_CACHING = True
#: A mixed prefill+decode step attends its single-row sequences with the split-K decode kernel.
DEFAULT_MIXED_STEP_DECODE_KERNEL = True
#: Which steps replay CUDA graphs (deepinfer.engine.execution): eager, decode, piecewise or full.
DEFAULT_EXECUTION_MODE = "full"
#: Every CUDA graph that ends a step also computes the logits and greedy tokens.
DEFAULT_GRAPH_SAMPLING = True
#: Seconds of compute a CPU worker's step of prompt tokens aims at (unset prefill_chunk_s): an abandoned prompt frees
#: the worker within about this long (a 2048-token step there is tens of seconds; a GPU step is milliseconds).
DEFAULT_CPU_PREFILL_CHUNK_S = 0.5
#: Seconds new requests of a burst may wait to join one step (0 = admit at the next step).
DEFAULT_ADMISSION_WINDOW_S = 0.0
#: Tokens and logprobs independent of the batch (slower).
DEFAULT_BATCH_INVARIANT = False
#: Devices one engine shards every layer over.
DEFAULT_TENSOR_PARALLEL_SIZE = 1
#: "auto" = the checkpoint's weights; "dummy" = random weights from config.json alone.
DEFAULT_LOAD_FORMAT = "auto"

# -- the router: SchedulerSettings, services.scheduler (its cost: services/scheduler/prefix_policy.py) -------------
#: Cost of each request on a worker, as a fraction of the routed prompt's tokens.
DEFAULT_LOAD_WEIGHT = 0.5
#: Cost of a worker's full KV pool, as a fraction of the routed prompt's tokens.
DEFAULT_KV_USAGE_WEIGHT = 1.0
#: The decode worker computes the prompt itself when it holds this fraction of the prompt's blocks.
DEFAULT_DIRECT_DECODE_MIN_FRACTION = 0.9
#: Most (worker, block) entries in the router's KV index.
DEFAULT_KV_INDEX_MAX_ENTRIES = 4_000_000
#: A worker is dead to the gateway and the router after this long without a heartbeat.
DEFAULT_WORKER_LEASE_S = 3.0

# -- the KV store: KvCacheSettings, deepinfer.kvcache.store.StoreSettings ------------------------------------------
#: RAM tier capacity of a store shard.
DEFAULT_STORE_RAM_BYTES = 4 << 30
#: Disk tier capacity of a store shard (live record bytes).
DEFAULT_STORE_DISK_BYTES = 64 << 30
#: A stored block expires this long after its last use (docs/architecture.md §5).
DEFAULT_STORE_TTL_S = 72 * 3600.0
#: When appended records are forced to stable storage: "none", "batch" or "always" (docs/kvstore.md).
DEFAULT_STORE_FSYNC = "none"

# -- every service: ServiceSettings, deepinfer.service --------------------------------------------------------------
#: After SIGTERM, the time to finish in-flight work.
DEFAULT_DRAIN_GRACE_S = 20.0
