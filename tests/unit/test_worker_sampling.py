"""The worker's engine SamplingParams: a seed drawn on the event loop for a request that set none, from a
generator seeded once (no getrandom syscall, which releases the GIL, per request); params without a seed or
lists are validated once and copied after, the same params and the same refusals as building them each time."""

from __future__ import annotations

import secrets

import pytest

from deepinfer.protocol import WireSamplingParams
from deepinfer.sampling.params import SamplingParamError
from deepinfer.sampling.params import SamplingParams as EngineSamplingParams
from deepinfer.worker import settings
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


def _as_built(wire: WireSamplingParams, seed: int) -> EngineSamplingParams:
    return EngineSamplingParams(**{**wire.model_dump(exclude={"v"}), "seed": seed})


@pytest.mark.parametrize("wire", [
    WireSamplingParams(),
    WireSamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_tokens=256, ignore_eos=True, logprobs=2),
    WireSamplingParams(temperature=0, max_tokens=None, min_tokens=3, grammar="start: /[a-z]+/"),
    WireSamplingParams(stop=["\n\n"], stop_token_ids=[2], logit_bias={50: -100.0}),  # the full way
    WireSamplingParams(seed=2**64 - 1),
])
def test_params_validated_once_are_those_built_each_time(wire):
    for _ in range(3):  # the first builds and keeps them, the others copy
        params = engine_sampling(wire)
        assert params == _as_built(wire, params.seed)
        assert type(params) is EngineSamplingParams
        assert wire.seed is None or params.seed == wire.seed


def test_copies_share_no_list_and_draw_their_own_seed():
    wire = WireSamplingParams(temperature=0.5)
    first, second = engine_sampling(wire), engine_sampling(wire)
    first.stop.append("x")
    first.stop_token_ids.append(7)
    assert second.stop == [] and second.stop_token_ids == [] and engine_sampling(wire).stop == []
    assert first.seed != second.seed


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": float("inf")}, "temperature"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"seed": 2**64}, "seed"),
])
def test_invalid_params_are_refused_every_time(fields, param):
    wire = WireSamplingParams(**fields)
    for _ in range(2):
        with pytest.raises(SamplingParamError) as refused:
            engine_sampling(wire)
        assert refused.value.param == param


def test_the_cache_of_validated_params_is_bounded(monkeypatch):
    monkeypatch.setattr(settings, "MAX_VALIDATED_PARAMS", 3)
    monkeypatch.setattr(settings, "_validated", {})
    for max_tokens in range(1, 10):
        assert engine_sampling(WireSamplingParams(max_tokens=max_tokens)).max_tokens == max_tokens
    assert len(settings._validated) <= 3
