"""Counter-based noise: bit-exact against a pure-Python splitmix64, uniform, uncorrelated, batch-independent."""

import numpy as np
import pytest
import torch

from deepinfer.sampling.random import (
    exponential_noise,
    exponential_noise_from_keys,
    host_row_keys,
    mix64,
    random_bits,
    row_keys,
    uniform_noise,
)

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _ref_mix64(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _ref_stream(state: int, index: int) -> int:
    return _ref_mix64(state + (index + 1) * _GAMMA)


def _ref_bits(seed: int, position: int, vocab_size: int) -> list[int]:
    row_key = _ref_stream(_ref_mix64(seed), position)
    return [_ref_stream(row_key, v) for v in range(vocab_size)]


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def test_reference_matches_published_splitmix64_vectors() -> None:
    # Vigna's splitmix64.c seeded with 1234567: the first five outputs.
    state, outputs = 1234567, []
    for i in range(5):
        outputs.append(_ref_stream(state, i))
    assert outputs == [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                       16408922859458223821]


def test_mix64_is_bit_exact_against_python_uint64() -> None:
    rng = np.random.default_rng(0)
    values = [0, 1, -1, 2**63 - 1, -(2**63), *rng.integers(-(2**63), 2**63 - 1, size=200, dtype=np.int64).tolist()]
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [_signed(_ref_mix64(v & _MASK64)) for v in values]


def test_random_bits_match_reference_for_any_seed_and_position() -> None:
    seeds = [0, 7, -1, 2**62 + 3, -(2**63)]
    positions = [0, 1, 4095, 123456789, 2**40]
    got = random_bits(torch.tensor(seeds), torch.tensor(positions), 37).tolist()
    for row, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        assert got[row] == [_signed(b) for b in _ref_bits(seed & _MASK64, position, 37)]


def test_uniforms_are_in_open_interval_and_look_uniform() -> None:
    vocab_size, num_rows = 4096, 64
    u = uniform_noise(torch.arange(num_rows) * 3 + 11, torch.arange(num_rows) + 100, vocab_size).double()
    assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
    flat = u.flatten().sort().values
    n = flat.numel()
    assert abs(flat.mean().item() - 0.5) < 4 * (1 / 12) ** 0.5 / n**0.5
    ks = (flat - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max().item()
    assert ks < 1.95 / n**0.5  # Kolmogorov-Smirnov, 0.1% level
    bits = (u * 2**24).long()
    for bit in range(1, 24):  # bit 0 is forced to 1
        assert abs(((bits >> bit) & 1).double().mean().item() - 0.5) < 0.01


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten() - a.double().mean(), b.double().flatten() - b.double().mean()
    return (a @ b / (a.norm() * b.norm())).item()


def test_no_correlation_between_adjacent_positions_seeds_and_tokens() -> None:
    vocab_size, num_rows = 2048, 32
    seeds, positions = torch.full((num_rows,), 5), torch.arange(num_rows)
    bound = 5 / (vocab_size * (num_rows - 1)) ** 0.5
    u = uniform_noise(seeds, positions, vocab_size)
    assert abs(_corr(u[:-1], u[1:])) < bound  # adjacent positions, same seed
    v = uniform_noise(torch.arange(num_rows), torch.full((num_rows,), 9), vocab_size)
    assert abs(_corr(v[:-1], v[1:])) < bound  # adjacent seeds, same position
    assert abs(_corr(u[:, :-1], u[:, 1:])) < bound  # adjacent token ids
    assert not torch.equal(u[0], v[5])


def test_noise_depends_only_on_seed_and_position() -> None:
    alone = uniform_noise(torch.tensor([42]), torch.tensor([17]), 500)
    batch = uniform_noise(torch.tensor([1, 2, 3, 42, 42]), torch.tensor([17, 17, 5, 17, 18]), 500)
    assert torch.equal(batch[3], alone[0])
    assert not torch.equal(batch[4], alone[0]) and not torch.equal(batch[0], alone[0])


def test_uint64_seed_equals_its_int64_wrap() -> None:
    from deepinfer.sampling.seeds import as_int64

    a = uniform_noise(torch.tensor([as_int64(2**64 - 3)]), torch.tensor([8]), 64)
    b = uniform_noise(torch.tensor([-3]), torch.tensor([8]), 64)
    assert torch.equal(a, b)


def test_exponential_noise_has_unit_mean() -> None:
    e = exponential_noise(torch.arange(16), torch.arange(16), 4096).double()
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())
    assert abs(e.mean().item() - 1.0) < 4 / (e.numel() ** 0.5)
    assert abs(e.var().item() - 1.0) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_give_identical_bits() -> None:
    seeds = torch.tensor([0, -1, 2**62 + 3, 99, -(2**63)])
    positions = torch.tensor([0, 1, 2**40, 7, 65535])
    vocab_size = 151_936
    cpu_bits = random_bits(seeds, positions, vocab_size)
    cuda_bits = random_bits(seeds.cuda(), positions.cuda(), vocab_size).cpu()
    assert torch.equal(cpu_bits, cuda_bits)
    assert torch.equal(uniform_noise(seeds, positions, vocab_size),
                       uniform_noise(seeds.cuda(), positions.cuda(), vocab_size).cpu())


def test_host_row_keys_are_the_device_arithmetics_bits() -> None:
    # The builder computes each row's key on the host (numpy uint64 lanes); the device's int64 tensor arithmetic
    # is the reference, edge values included (int64 extremes, -1, positions past 2**32).
    rng = np.random.default_rng(1)
    seeds = np.concatenate([[0, -1, 2**63 - 1, -(2**63), 7], rng.integers(-(2**63), 2**63 - 1, size=300)])
    positions = np.concatenate([[0, 1, 2**40, 2**62, 4095], rng.integers(0, 2**33, size=300)])
    seeds, positions = seeds.astype(np.int64), positions.astype(np.int64)
    want = row_keys(torch.from_numpy(seeds), torch.from_numpy(positions)).numpy()
    assert (host_row_keys(seeds, positions) == want).all()
    out = np.full_like(seeds, 5)
    assert host_row_keys(seeds, positions, out=out) is not None and (out == want).all()
    assert (seeds[:2] == [0, -1]).all()  # the inputs are left as they were


def test_noise_from_host_keys_is_the_noise_from_seeds_and_positions() -> None:
    seeds, positions = np.array([3, -9, 2**62], dtype=np.int64), np.array([0, 17, 2**35], dtype=np.int64)
    keys = torch.from_numpy(host_row_keys(seeds, positions))
    want = exponential_noise(torch.from_numpy(seeds), torch.from_numpy(positions), 101)
    assert torch.equal(exponential_noise_from_keys(keys, 101), want)
    assert torch.equal(exponential_noise_from_keys(keys, 101), want)  # the cached counters give the same
