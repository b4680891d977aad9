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

A step's row keys are [B] values known on the host: `host_row_keys` computes them there (numpy uint64, the same
bits), so the sampler launches only the [B, V] part (`exponential_noise_from_keys`); on the device `row_keys` is
two dozen kernels of a few elements each, every one a launch on the step's host path.
"""

from __future__ import annotations

import numpy as np
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


def host_row_keys(seeds: np.ndarray, positions: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`row_keys` on the host: int64 [B] from int64 seeds and positions (uint64 lanes: the same bits), into
    `out` when given (int64 [B])."""
    return host_keys_from_states(host_seed_states(seeds), positions, out)


def host_seed_states(seeds: np.ndarray) -> np.ndarray:
    """Each seed's stream state, mix64(seed): uint64 [B] (a request's is the same every step)."""
    states = seeds.astype(np.int64).view(np.uint64)
    _host_mix64(states, np.empty_like(states))
    return states


def host_keys_from_states(states: np.ndarray, positions: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The rows' keys from their seed states (`host_seed_states`) and positions: int64 [B], into `out` if given."""
    keys = (np.empty(len(states), dtype=np.int64) if out is None else out).view(np.uint64)
    np.add(positions.view(np.uint64), _ONE, out=keys)
    np.multiply(keys, _GAMMA_U, out=keys)
    keys += states
    _host_mix64(keys, np.empty_like(keys))
    return keys.view(np.int64)


def _host_mix64(x: np.ndarray, scratch: np.ndarray) -> None:
    """splitmix64's finaliser in place on uint64 lanes (numpy's array ops wrap mod 2**64)."""
    for shift, mul in ((_S30, _MUL1_U), (_S27, _MUL2_U), (_S31, None)):
        np.right_shift(x, shift, out=scratch)
        x ^= scratch
        if mul is not None:
            np.multiply(x, mul, out=x)


_ONE, _S27, _S30, _S31 = np.uint64(1), np.uint64(27), np.uint64(30), np.uint64(31)
_GAMMA_U, _MUL1_U, _MUL2_U = (np.int64(v).view(np.uint64) for v in (GAMMA, _MUL1, _MUL2))
#: (device, vocab size) -> the [V] stream counters (v + 1) * GAMMA, made once.
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _counters(vocab_size: int, device: torch.device) -> torch.Tensor:
    counters = _COUNTERS.get((device, vocab_size))
    if counters is None:
        counters = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device) * GAMMA
        _COUNTERS[device, vocab_size] = counters
    return counters


def random_bits_from_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """64 random bits per (row, token): [B, V] int64 from the rows' keys (`row_keys`)."""
    return mix64(keys.unsqueeze(1) + _counters(vocab_size, keys.device))


def random_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """64 random bits per (row, token): [B, V] int64, a function of (seeds[b], positions[b], v) only."""
    return random_bits_from_keys(row_keys(seeds, positions), vocab_size)


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    return (_shr(bits, 64 - _UNIFORM_BITS) | 1).to(torch.float32) * (2.0**-_UNIFORM_BITS)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in the open interval (0, 1): [B, V] float32, bit-identical on every device."""
    return _uniform(random_bits(seeds, positions, vocab_size))


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws, -log(u): [B, V] float32; argmax(probs / noise) samples a token from probs exactly."""
    return exponential_noise_from_keys(row_keys(seeds, positions), vocab_size)


def exponential_noise_from_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`exponential_noise` from the rows' keys (`row_keys`, or `host_row_keys` uploaded)."""
    return _uniform(random_bits_from_keys(keys, vocab_size)).log_().neg_()
