"""`EngineArgs`: everything needed to build one engine, with the defaults in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from deepinfer.cpus import has_bf16_instructions
from deepinfer.defaults import (
    DEFAULT_ACCELERATOR,
    DEFAULT_ADMISSION_WINDOW_S,
    DEFAULT_BATCH_INVARIANT,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_ENABLE_PREFIX_CACHING,
    DEFAULT_EXECUTION_MODE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_GRAPH_SAMPLING,
    DEFAULT_LOAD_FORMAT,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MIXED_STEP_DECODE_KERNEL,
    DEFAULT_TENSOR_PARALLEL_SIZE,
)
from deepinfer.engine.execution import ExecutionMode
from deepinfer.engine.spec_config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

#: How weights are loaded (vLLM's names).
LOAD_FORMATS = ("auto", "dummy")


@dataclass(kw_only=True)
class EngineArgs:
    """How to build an engine: which model, where, and the cache/batch knobs (vLLM's names)."""

    #: A Hugging Face directory, a .gguf file, or a known name (None = the default model).
    model: str | Path | None = None
    #: "auto" = bfloat16 on a GPU and on a CPU with bf16 instructions (deepinfer.cpus.has_bf16_instructions:
    #: avx512_bf16, amx_bf16), float32 on other CPUs.
    dtype: str | torch.dtype = DEFAULT_DTYPE
    #: "auto" = the GPU when there is one, else the CPU.
    device: str = DEFAULT_DEVICE
    #: "auto" | "cpu" | "cuda" | "ascend": which kernels to use (deepinfer.kernels).
    accelerator: str = DEFAULT_ACCELERATOR
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    #: None = the model's max_position_embeddings, capped at 8192 so the CPU default budget holds it.
    max_model_len: int | None = None
    #: Fraction of GPU memory the engine may use (weights + activations + KV).
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    #: KV budget in bytes; None = from gpu_memory_utilization on a GPU; on the CPU room for 8 full-length
    #: sequences, at most 1 GiB.
    kv_cache_bytes: int | None = None
    #: Bytes of the host-memory KV tier (pinned on CUDA; deepinfer.engine.host_tier); 0 = off; None = on for one
    #: CUDA device (deepinfer.engine.memory.default_host_tier_bytes), off on the CPU and with tensor parallelism.
    kv_host_cache_bytes: int | None = None
    #: Load or recompute a cached prefix held in a lower tier: "measured" = whichever is faster at the measured
    #: rates (deepinfer.kv_costs); "load" = always load what a tier holds (benches measuring a load path).
    kv_load_choice: Literal["measured", "load"] = "measured"
    enable_prefix_caching: bool = DEFAULT_ENABLE_PREFIX_CACHING
    #: Processes (one per GPU, or CPU processes over gloo) that each hold 1/N of every layer.
    tensor_parallel_size: int = DEFAULT_TENSOR_PARALLEL_SIZE
    enable_kv_events: bool = False
    #: Pins the model fingerprint in block hashes (else computed from the files).
    model_revision: str | None = None
    #: Where prepared models live (None = the XDG default, ~/.cache/deepinfer/models).
    model_cache_dir: Path | None = None
    progress: bool = True
    #: "auto" = the checkpoint's weights; "dummy" = random weights from config.json alone (benchmarks, no files).
    load_format: str = DEFAULT_LOAD_FORMAT
    #: Seed of the "dummy" weights (same seed, same weights on the same device).
    dummy_seed: int = 0
    #: Which steps replay CUDA graphs (deepinfer.engine.execution): "eager", "decode" (decode-only steps),
    #: "piecewise" (and steps with prompt rows as piecewise graphs: all but attention, per token bucket) or
    #: "full" (steps with prompt rows as one graph per token bucket, attention inside). Lowered where it cannot
    #: run: eager on the CPU and with tensor parallelism, decode graphs at most in batch-invariant mode.
    execution_mode: str = DEFAULT_EXECUTION_MODE
    #: vLLM's name for execution_mode="eager" (`LLM(model, enforce_eager=True)`).
    enforce_eager: bool = False
    #: True = a mixed prefill+decode step attends its single-row sequences with the split-K decode kernel and only
    #: its prompts with the prefill kernel (kernels.triton_ops.paged_attention); False = one kernel for the step.
    mixed_step_decode_kernel: bool = DEFAULT_MIXED_STEP_DECODE_KERNEL
    #: True = every CUDA graph that ends a step (decode graphs; full graphs of prompt steps) also computes the
    #: logits and each row's greedy token with its logprob: an all-greedy step without penalties, bias or top
    #: logprobs launches no sampler (deepinfer.engine.cuda_graphs).
    graph_sampling: bool = DEFAULT_GRAPH_SAMPLING
    #: Seconds a new request arriving in a burst while others run may wait so the burst joins one step
    #: (deepinfer.engine.admission_window; 0 = admit at the next step).
    admission_window_s: float = DEFAULT_ADMISSION_WINDOW_S
    #: Python's switch interval while a prefill or mixed step launches its layers (deepinfer.engine.runner;
    #: None = the process's own): a shorter one returns the GIL to the engine thread sooner after each launch.
    eager_step_switch_interval_s: float | None = None
    #: True = a request's tokens and logprobs do not depend on the batch it runs in (vLLM's name): linears run a
    #: fixed-tile matmul and attention a fixed split (deepinfer.engine.runner); slower. The workers' settings
    #: read DEEPINFER_{PREFILL,DECODE}_BATCH_INVARIANT; the engine reads only this field.
    batch_invariant: bool = DEFAULT_BATCH_INVARIANT
    #: True = schedule step N+1 on the host while the device runs step N (vLLM's name): the next step's inputs
    #: take the tokens sampled by the step in flight on the device (deepinfer.engine.async_scheduler). Same
    #: tokens as the synchronous loop; a step after one that used penalties waits for its tokens first.
    #: None = auto: on for a single CUDA device (the host's step work then hides under the device's), off on the
    #: CPU (nothing to overlap) and with tensor parallelism (not tested across ranks).
    async_scheduling: bool | None = None
    #: Seconds of compute the prompt tokens of one step aim at, from the measured seconds per token
    #: (deepinfer.engine.chunk_timer), so an abort or a new request waits about that long at most; synchronous
    #: scheduling only. None or 0 = off: the token budget alone, and steps that do not depend on the machine's speed
    #: (the offline engine's default; a CPU worker sets it, deepinfer.worker.settings).
    prefill_chunk_s: float | None = None
    #: Speculative decoding, vLLM's dict (deepinfer.engine.spec_config; docs/speculative.md), e.g.
    #: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}; held as a
    #: validated SpeculativeConfig once built. None = off. With async scheduling, steps run asynchronously while no
    #: request carries a draft and synchronously when some do (EngineCore._step_speculative); not with
    #: batch_invariant or tensor parallelism yet.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    #: KV by layer type for models with sliding-window layers (Gemma 3, Mistral; engine/hybrid_kv_manager.py,
    #: docs/models.md): a local layer's blocks are freed as its window moves and a prefix hit replays at most about
    #: hybrid_checkpoint_tokens. For now: eager steps (the execution mode is lowered to eager), synchronous
    #: scheduling, one device, no host tier, no P/D handoff or store loads (refused, or recomputed). Off = every
    #: layer keeps every block (vLLM turns its hybrid manager off with --disable-hybrid-kv-cache-manager).
    enable_hybrid_kv_cache: bool = False
    #: With enable_hybrid_kv_cache: the windows before every multiple of this many tokens are evicted last, so a
    #: hit replays at most about this many tokens (a multiple of block_size).
    hybrid_checkpoint_tokens: int = 1024

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.execution_mode not in tuple(ExecutionMode):
            modes = ", ".join(m.value for m in ExecutionMode)
            raise ValueError(f"execution_mode must be one of {modes}, got {self.execution_mode!r}")
        if self.prefill_chunk_s is not None and self.prefill_chunk_s < 0:
            raise ValueError(f"prefill_chunk_s must be >= 0, got {self.prefill_chunk_s}")
        if self.kv_host_cache_bytes is not None and self.kv_host_cache_bytes < 0:
            raise ValueError(f"kv_host_cache_bytes must be >= 0, got {self.kv_host_cache_bytes}")
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if self.speculative_config is not None:
            if self.batch_invariant:
                raise ValueError("speculative_config does not run with batch_invariant=True yet")
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative_config does not run with tensor_parallel_size > 1 yet")
            if self._mtp and self.async_scheduling:
                raise ValueError("speculative_config method 'mtp' does not run with async_scheduling=True yet")
        if self.enable_hybrid_kv_cache:
            self._check_hybrid_kv_cache()

    def _check_hybrid_kv_cache(self) -> None:
        """ValueError naming the first setting enable_hybrid_kv_cache does not run with yet."""
        n = self.hybrid_checkpoint_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < self.block_size or n % self.block_size:
            raise ValueError(f"hybrid_checkpoint_tokens must be a multiple of block_size={self.block_size}, got {n!r}")
        for name, bad in (("async_scheduling=True", self.async_scheduling is True),
                          ("kv_host_cache_bytes", bool(self.kv_host_cache_bytes)),
                          ("tensor_parallel_size > 1", self.tensor_parallel_size > 1),
                          ("batch_invariant=True", self.batch_invariant)):
            if bad:
                raise ValueError(f"enable_hybrid_kv_cache does not run with {name} yet")

    @property
    def _mtp(self) -> bool:
        """Speculative decoding by the model's MTP layer (eager and synchronous steps for now: engine/mtp_drafter.py)."""
        spec = self.speculative_config
        return spec is not None and getattr(spec, "method", None) == "mtp"

    def resolve_device(self) -> torch.device:
        """The torch device to run on."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_async_scheduling(self, device: torch.device) -> bool:
        """Whether the engine schedules step N+1 while step N runs (see async_scheduling)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return (device.type == "cuda" and self.tensor_parallel_size == 1 and not self.enable_hybrid_kv_cache
                and not self._mtp)

    def resolve_execution_mode(self, device: torch.device, accelerator: str) -> ExecutionMode:
        """The execution mode this engine builds: the one asked for, lowered to what it can run (module docstring
        of deepinfer.engine.execution)."""
        if (self.enforce_eager or device.type != "cuda" or accelerator != "cuda" or self.tensor_parallel_size > 1
                or self.enable_hybrid_kv_cache or self._mtp):
            return ExecutionMode.EAGER
        mode = ExecutionMode(self.execution_mode)
        return mode.at_most(ExecutionMode.DECODE) if self.batch_invariant else mode
    def resolve_prefill_chunk_s(self) -> float | None:
        """Seconds a step's prompt tokens aim at (see prefill_chunk_s); None = no time bound."""
        return self.prefill_chunk_s or None

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of weights and KV cache."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            return torch.float32 if device.type == "cpu" and not has_bf16_instructions() else torch.bfloat16
        try:
            return _DTYPES[self.dtype.lower()]
        except KeyError:
            raise ValueError(f"dtype must be auto or one of {', '.join(sorted(_DTYPES))}, got {self.dtype!r}") from None
