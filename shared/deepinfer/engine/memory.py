"""KV-cache memory planning: how many blocks fit, decided once at start, with the numbers on failure; and the
caches' allocation."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

#: CPU budget when none is configured: enough for tests and local chat, small beside 24 GB of RAM.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


#: The host tier of an engine on one CUDA device when kv_host_cache_bytes is unset: this much, at most
#: HOST_TIER_MEMORY_FRACTION of the host memory the process may use, rounded down to a power of two (torch's
#: pinned allocator rounds an allocation up to one); under MIN_DEFAULT_HOST_TIER_BYTES, off.
DEFAULT_HOST_TIER_BYTES = 8 << 30
HOST_TIER_MEMORY_FRACTION = 0.25
MIN_DEFAULT_HOST_TIER_BYTES = 256 << 20


def default_host_tier_bytes(usable_memory: int | None) -> int:
    """The host tier's bytes when unset, given the host memory this process may use (None: unknown)."""
    cap = DEFAULT_HOST_TIER_BYTES
    if usable_memory is not None:
        cap = min(cap, int(usable_memory * HOST_TIER_MEMORY_FRACTION))
    return 0 if cap < MIN_DEFAULT_HOST_TIER_BYTES else 1 << (cap.bit_length() - 1)


class KvCacheTooSmall(ValueError):
    """The model leaves too little memory for the minimum KV cache (one max_model_len sequence)."""


@dataclass(frozen=True)
class KvCachePlan:
    """Outcome of planning: blocks, bytes and the per-token cost they came from."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    budget_bytes: int

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds (block 0 is the reserved padding block)."""
        return (self.num_blocks - 1) * self.block_size


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """K and V of every layer for one block."""
    return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes


def plan_kv_cache(
    *,
    budget_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    what: str,
    tables_per_sequence: int = 1,
) -> KvCachePlan:
    """Turn a byte budget into a block count; fail with the numbers when one full-length sequence cannot fit (in
    each of its `tables_per_sequence` block tables: KV groups, whose blocks are pages of one group's layers)."""
    num_blocks = max(budget_bytes, 0) // bytes_per_block
    min_blocks = -(-max_model_len // block_size) * tables_per_sequence + 1  # + the reserved padding block
    if num_blocks < min_blocks:
        raise KvCacheTooSmall(
            f"KV cache too small on {what}: {_gib(budget_bytes)} left for KV gives {num_blocks} blocks of "
            f"{bytes_per_block} bytes ({block_size} tokens), but max_model_len={max_model_len} needs at least "
            f"{min_blocks} blocks ({_gib(min_blocks * bytes_per_block)}). Lower max_model_len, raise the KV budget "
            "(kv_cache_bytes / gpu_memory_utilization) or use a smaller dtype."
        )
    return KvCachePlan(num_blocks, block_size, bytes_per_block, budget_bytes)


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's KV cache, all zeros. On the CPU it is an anonymous mapping: the kernel's zero pages, each mapped
    at its first write, so an engine starts without touching the whole cache. torch.zeros writes every page up
    front: 1.5-3 s of page faults per GiB on the development VM, for a 1 GiB default a CPU worker mostly never
    uses. On an accelerator, torch.zeros (one memset)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    # frombuffer keeps the mapping alive as long as the tensor; the mapping is page-aligned.
    return torch.frombuffer(mmap.mmap(-1, num_bytes), dtype=dtype).view(shape)


def _gib(num_bytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):.2f} {unit}"
    return f"{num_bytes} bytes"
