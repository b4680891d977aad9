"""KV groups: a hybrid model's layers split by attention type into groups of equal size over one block pool. No torch.

Gemma 3 interleaves local (sliding-window) layers with global ones; a local layer never reads a key older than its
window, so its blocks can be freed as the window moves while a global layer keeps them all (docs/models.md, "KV by
layer type", the plan of issue #33). Layers of one type are split into groups of `group_size` layers, every group
the same size, so a page of the pool is one block of *one* group's layers and the pool's memory is pages x
group_size layers, not pages x every layer:

    Gemma 3 270M, 18 layers, every sixth global:      group size gcd(15 local, 3 global) = 3
        group 0 (global): layers  5 11 17
        group 1 (local):  layers  0  1  2      each group holds its own block table per request;
        group 2 (local):  layers  3  4  6      layer j of every group reads slot j of the same buffers
        ...                                    (5 local groups)

Groups with a window come after the full-attention ones, so group 0 is always a full-attention group when the model
has one: its block hashes are the request's own (what KV events, the router and the tiers know); every other group
keys its cached blocks by the hash and its group index (`group_block_hash`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    """Layers whose KV blocks move together: `sliding_window` None = full attention (every block kept), else a
    query at position p reads keys (p - sliding_window, p] only."""

    layers: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def is_local(self) -> bool:
        """True for a sliding-window group (its out-of-window blocks can be freed)."""
        return self.sliding_window is not None


def kv_groups(layer_windows: Sequence[int | None]) -> list[KVGroup]:
    """Groups of equal size (the gcd of the layer counts per window) for layers with these windows (None = full
    attention), full-attention groups first, each group's layers in model order. One group of every layer when all
    windows are equal (a plain model: no hybrid accounting)."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if window is not None and window < 1:
            raise ValueError(f"layer {layer}: sliding_window must be >= 1 or None, got {window}")
        by_window.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return [KVGroup(tuple(by_window[w][i : i + size]), w) for w in order for i in range(0, len(by_window[w]), size)]


def group_block_hash(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of `group`: the request's hash for group 0, tagged with the group index for
    the others (each group's blocks are distinct pages of the one pool)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


def first_needed_token(num_computed_tokens: int, sliding_window: int) -> int:
    """The oldest position a query at `num_computed_tokens` (the next token to compute) can read through a window:
    keys (p - W, p], so p - W + 1 (0 while the sequence is shorter than the window)."""
    return max(0, num_computed_tokens - sliding_window + 1)
