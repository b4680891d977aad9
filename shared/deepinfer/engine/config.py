"""Scheduler and KV-cache knobs of one engine, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.defaults import (
    DEFAULT_ADMISSION_WINDOW_S,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_ENABLE_PREFIX_CACHING,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
)
from deepinfer.engine.kv_groups import KVGroup


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What the scheduler needs: cache geometry, batch limits and prefix-cache switches."""

    #: KV blocks in the pool, block 0 (the padding block) included.
    num_blocks: int
    #: Longest sequence (prompt + output) in tokens.
    max_model_len: int
    block_size: int = DEFAULT_BLOCK_SIZE
    #: Most requests in the running batch.
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    #: Token budget of one step, shared by decodes and prefill chunks.
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = DEFAULT_ENABLE_PREFIX_CACHING
    #: Cap on one prefill chunk, so a long prompt cannot take a whole step; None = only the budget caps it.
    long_prefill_token_threshold: int | None = None
    #: Identity of the model in block hashes (deepinfer.hashing.model_fingerprint).
    model_fingerprint: bytes = b""
    #: Buffer Stored/Removed events for take_kv_events; turn off when nobody takes them (offline use).
    enable_kv_events: bool = True
    #: New requests arriving in a burst while others run wait up to this long to join one step (0 = off;
    #: deepinfer.engine.admission_window).
    admission_window_s: float = DEFAULT_ADMISSION_WINDOW_S
    #: KV by layer type (EngineArgs.enable_hybrid_kv_cache): the model's KV groups, each request holding one block
    #: table per group (engine/hybrid_kv_manager.py); empty = one table for every layer. num_blocks then counts
    #: pages of one group's layers.
    kv_groups: tuple[KVGroup, ...] = ()
    #: With kv_groups: the local groups' windows before every multiple of this many tokens are evicted last.
    hybrid_checkpoint_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.admission_window_s < 0:
            raise ValueError(f"admission_window_s must be >= 0, got {self.admission_window_s}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold <= 0:
            raise ValueError(
                f"long_prefill_token_threshold must be positive, got {self.long_prefill_token_threshold}"
            )
        min_blocks = -(-self.max_model_len // self.block_size) * max(1, len(self.kv_groups)) + 1
        if self.num_blocks < min_blocks:
            # A request that cannot fit even alone would preempt itself forever.
            raise ValueError(
                f"num_blocks={self.num_blocks} cannot hold one max_model_len={self.max_model_len} sequence: "
                f"it needs {min_blocks} blocks of {self.block_size} tokens (block 0 is reserved)"
            )
