"""Load or recompute: how much of a request's cached prefix is worth loading, from one worker's measured rates.
Pure (no torch): the worker's admission and the router's credit apply the same rule.

A prompt's cached prefix is a run of blocks per tier, in token order, and a load is contiguous from its first
block (the engine computes from the first token not loaded), so the choice is a prefix length n:

    blocks   [ device ─ d │ host ─ h │ store ─ s │ not cached ]         runs = [(DEVICE, d), (HOST, h), (STORE, s)]
    time(n)  = Σ_{i<n} block_load_s(tier of block i) + (d + h + s − n) × block_recompute_s
               block_load_s(DEVICE) = 0; block_load_s(tier) = kv_bytes_per_block / that tier's bytes/s
               block_recompute_s = block_size / prefill_tokens_per_s

`blocks_to_load` is the n of least time(n). Within a run time(n) is linear, so the least is at 0 or at a run's end;
ties go to the longer load. That is "load while a tier loads a block faster than the worker computes one", except
that a slow run is still loaded when a fast run after it pays for it. A tier with no rate (None: the worker has no
such tier) ends the prefix: nothing from it on is loadable. `seconds_saved` = time(0) − time(n), never negative.

Loads are waited for before the rest is computed (the request waits in WAITING_FOR_REMOTE_KVS): a load overlapped
with the prefill of the rest, chunk by chunk, is a later step, so a tier slower than recomputing is recomputed, not
raced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: The tiers a cached block can sit in, in the order a prefix runs through them.
DEVICE = "device"
HOST = "host"
STORE = "store"


@dataclass(frozen=True)
class KvCosts:
    """One worker's measured rates, as a load-or-recompute rule (module docstring)."""

    block_size: int
    kv_bytes_per_block: int
    prefill_tokens_per_s: float
    #: Bytes per second of a load from the host tier / the kvcache store (None: the worker has no such tier).
    host_bytes_per_s: float | None
    store_bytes_per_s: float | None
    #: kv_load_choice "load": every tier with a rate loads as if free, so whatever a tier holds is loaded (to
    #: measure a load path, or on hardware whose rates are known to favour loads); the rule above otherwise.
    always_load: bool = False

    def block_recompute_s(self) -> float:
        """Seconds to compute one block's tokens."""
        return self.block_size / self.prefill_tokens_per_s

    def block_load_s(self, tier: str) -> float:
        """Seconds to load one block from `tier` (inf when the worker cannot load from it)."""
        if tier == DEVICE:
            return 0.0
        rate = {HOST: self.host_bytes_per_s, STORE: self.store_bytes_per_s}[tier]
        if not rate or rate <= 0:
            return math.inf
        return 0.0 if self.always_load else self.kv_bytes_per_block / rate

    def worth_loading(self, tier: str) -> bool:
        """Whether a block of `tier` loads at least as fast as it is computed (a tie loads, as in blocks_to_load)."""
        return self.block_load_s(tier) <= self.block_recompute_s()

    def time_s(self, runs: Sequence[tuple[str, int]], num_loaded: int) -> float:
        """time(n) of the module docstring: load the first `num_loaded` cached blocks, compute the other ones."""
        total_s, left = 0.0, num_loaded
        for tier, num_blocks in runs:
            take = min(left, num_blocks)
            if take:
                total_s += take * self.block_load_s(tier)
            total_s += (num_blocks - take) * self.block_recompute_s()
            left -= take
        return total_s

    def blocks_to_load(self, runs: Sequence[tuple[str, int]]) -> int:
        """The prefix length n (blocks) of least time(n); ties go to the longer load."""
        best_n, best_s, end = 0, self.time_s(runs, 0), 0
        for tier, num_blocks in runs:
            if num_blocks <= 0:
                continue
            if math.isinf(self.block_load_s(tier)):
                break
            end += num_blocks
            time_s = self.time_s(runs, end)
            if time_s <= best_s:
                best_n, best_s = end, time_s
        return best_n

    def seconds_saved(self, runs: Sequence[tuple[str, int]]) -> float:
        """Seconds the best load saves against computing every cached block (0 when nothing is worth loading)."""
        return self.time_s(runs, 0) - self.time_s(runs, self.blocks_to_load(runs))

    def tokens_saved(self, runs: Sequence[tuple[str, int]]) -> float:
        """`seconds_saved` in prompt tokens this worker computes in that time (the router's unit)."""
        return self.seconds_saved(runs) * self.prefill_tokens_per_s
