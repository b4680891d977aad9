"""Counter-based noise on device: u[b, v] = hash(seed[b], position[b], v), integer ops only.

The draw for a row depends only on (seed, position): never on the batch it sits in, on the other rows, on a global
generator or on the device. The hash is splitmix64 (Steele, Lea, Flood 2014) computed in int64 tensors, whose
add/mul wrap mod 2**64 like uint64 and whose xor is the same; only right shifts differ (arithmetic), so they are
masked to act as logical shifts. The integer bits are therefore identical on CPU and CUDA, and so is the one
float conversion that follows (24 bits, exact in float32).

    stream(s)[i]   = mix64(s + (i + 1) * GAMMA)           splitmix64's i-th output from state s
    row_key        = stream(mix64(seed))[position]
    bits[b, v]     = stream(row_key)[v]
    u[b, v]        = (top 24 bits of bits, lowest forced to 1) / 2**24   in (0, 1), mean exactly 1/2
"""

from __future__ import annotations

import torch

from deepinfer.sampling.seeds import as_int64

GAMMA = as_int64(0x9E3779B97F4A7C15)
_MUL1 = as_int64(0xBF58476D1CE4E5B9)
_MUL2 = as_int64(0x94D049BB133111EB)
_UNIFORM_BITS = 24


def _shr(x: torch.Tensor, shift: int) -> torch.Tensor:
    # Logical right shift of int64 lanes: `>>` sign-extends, the mask clears the copied sign bits.
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (uint64 semantics: wrap-around mul, logical shifts)."""
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-row stream keys: the position-th splitmix64 output of the stream seeded by mix64(seed); [B] int64."""
    return mix64(mix64(seeds) + (positions + 1) * GAMMA)


def random_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """64 random bits per (row, token): [B, V] int64, a function of (seeds[b], positions[b], v) only."""
    counters = (torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device) * GAMMA)  # [V]
    return mix64(row_keys(seeds, positions).unsqueeze(1) + counters)  # [B, V]


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in the open interval (0, 1): [B, V] float32, bit-identical on every device."""
    bits = _shr(random_bits(seeds, positions, vocab_size), 64 - _UNIFORM_BITS) | 1
    return bits.to(torch.float32) * (2.0**-_UNIFORM_BITS)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws, -log(u): [B, V] float32; argmax(probs / noise) samples a token from probs exactly."""
    return uniform_noise(seeds, positions, vocab_size).log_().neg_()
