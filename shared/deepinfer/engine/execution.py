"""How the runner executes a step: one execution mode chosen at build, and the runner's configuration.

    mode        decode-only steps        steps with prompt rows (prefill, mixed)
    eager       eager                    eager
    decode      CUDA graph replay        eager
    piecewise   CUDA graph replay        piecewise graphs (everything but attention captured per token bucket)
    full        CUDA graph replay        one graph per token bucket, attention inside

as vLLM's `cudagraph_mode` (NONE, FULL_DECODE_ONLY, FULL_AND_PIECEWISE, FULL) replaced its booleans. The mode asked for
is what the build may use: `EngineArgs.resolve_execution_mode` lowers it where the device or the options cannot run it
(the CPU, tensor parallelism: eager; batch-invariant mode: decode graphs at most), and a model without graph-mode
attention runs its prompt steps eagerly (`ModelRunner.mode` is what was built). `graph_sampling`: every graph that
ends a step also computes the sampled rows' logits and greedy tokens (`deepinfer.engine.cuda_graphs`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.defaults import (
    DEFAULT_BATCH_INVARIANT,
    DEFAULT_GRAPH_SAMPLING,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MIXED_STEP_DECODE_KERNEL,
)


class ExecutionMode(enum.StrEnum):
    """Which steps replay CUDA graphs (module docstring); ordered: each mode graphs more than the one before."""

    EAGER = "eager"
    DECODE = "decode"
    PIECEWISE = "piecewise"
    FULL = "full"

    @property
    def decode_graphs(self) -> bool:
        """Decode-only steps replay CUDA graphs."""
        return self is not ExecutionMode.EAGER

    @property
    def prompt_graphs(self) -> bool:
        """Steps with prompt rows run graphs too (piecewise or full)."""
        return self in (ExecutionMode.PIECEWISE, ExecutionMode.FULL)

    def at_most(self, limit: ExecutionMode) -> ExecutionMode:
        """This mode, lowered to `limit` if it graphs more."""
        order = list(ExecutionMode)
        return self if order.index(self) <= order.index(limit) else limit


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """What a `ModelRunner` is built with besides its model and KV caches."""

    block_size: int
    vocab_size: int
    device: torch.device
    #: Banned while a request is below its min_tokens.
    eos_token_ids: Sequence[int] = ()
    #: Width of the block tables (None: grows on demand; graphs and batch-invariant mode need it).
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    #: The mode asked for, already resolved for the device (`EngineArgs.resolve_execution_mode`).
    execution_mode: ExecutionMode = ExecutionMode.EAGER
    #: The graphs that end a step compute its logits and greedy tokens (off in batch-invariant mode).
    graph_sampling: bool = DEFAULT_GRAPH_SAMPLING
    #: A request's tokens do not depend on its batch (deepinfer.engine.runner's module docstring).
    batch_invariant: bool = DEFAULT_BATCH_INVARIANT
    #: A mixed step attends its single-row sequences with the split-K decode kernel (off: one kernel a step).
    mixed_step_decode_kernel: bool = DEFAULT_MIXED_STEP_DECODE_KERNEL
    #: Python's switch interval while a step with prompt rows launches its layers (None: unchanged).
    eager_step_switch_interval_s: float | None = None
    #: KV by layer type (engine/kv_groups.py): each layer's KV group; the scheduler sends every group's block ids
    #: interleaved and each layer reads its group's table. () = one table for every layer.
    kv_group_of_layer: tuple[int, ...] = ()

    @property
    def num_kv_groups(self) -> int:
        """Block tables per request (1 without KV groups)."""
        return max(self.kv_group_of_layer, default=0) + 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "execution_mode", ExecutionMode(self.execution_mode))  # a name is accepted too
        if self.kv_group_of_layer and self.execution_mode != ExecutionMode.EAGER:
            raise ValueError("KV groups (enable_hybrid_kv_cache) run eager steps only")
        if self.batch_invariant and self.max_model_len is None:
            raise ValueError("batch_invariant needs max_model_len (the fixed split of decode attention)")
        if self.execution_mode.decode_graphs and self.max_model_len is None:
            raise ValueError("CUDA graphs need max_model_len (the width of the captured block tables)")
