"""Host-side seed handling (no torch): draw a seed at admission, derive one per sequence, fit it in int64.

The on-device draw (`deepinfer.sampling.random`) is a function of (seed, position) only. A request that gave no seed
gets one from `draw_seed()` when it is admitted, and that seed travels with the request (prefill → decode → a
migrated decode), so every worker draws the same tokens. The n sequences of one request use
`derive_seed(seed, index)`, index 0 keeping the request's own seed.
"""

from __future__ import annotations

import secrets

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def draw_seed() -> int:
    """A fresh random seed in [0, 2**63) for a request that did not set one."""
    return secrets.randbits(63)


def as_int64(seed: int) -> int:
    """The seed's 64 bits read as a signed int64 (uint64 seeds wrap), the form device tensors hold."""
    seed &= _MASK64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def derive_seed(seed: int, index: int) -> int:
    """The seed of sequence `index` of a request with `n > 1` (index 0 keeps `seed`); deterministic on every host."""
    if index == 0:
        return seed
    return as_int64(_mix64((seed + index * _GAMMA) & _MASK64))


def _mix64(z: int) -> int:
    # splitmix64's finaliser on Python ints (uint64 semantics by masking).
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
