"""The worker's engine SamplingParams: a seed drawn on the event loop for a request that set none, from a
generator seeded once (no getrandom syscall, which releases the GIL, per request)."""

from __future__ import annotations

import secrets

from deepinfer.protocol import SamplingParams as WireSamplingParams
from deepinfer.worker.settings import engine_sampling


def test_a_request_without_a_seed_gets_a_fresh_one_and_a_set_seed_is_kept():
    wire = WireSamplingParams(temperature=0.7, max_tokens=8)
    seeds = {engine_sampling(wire).seed for _ in range(100)}
    assert len(seeds) == 100
    assert all(seed is not None and 0 <= seed < 2**63 for seed in seeds)
    assert engine_sampling(WireSamplingParams(temperature=0.7, seed=1234)).seed == 1234
    params = engine_sampling(wire)
    assert (params.temperature, params.max_tokens) == (0.7, 8)


def test_seeds_come_without_asking_the_os_each_time(monkeypatch):
    def no_syscall(*args):
        raise AssertionError("a getrandom syscall per request")

    monkeypatch.setattr(secrets, "randbits", no_syscall)
    monkeypatch.setattr(secrets, "token_bytes", no_syscall)
    assert engine_sampling(WireSamplingParams()).seed is not None
