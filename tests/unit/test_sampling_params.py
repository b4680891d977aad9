"""SamplingParams: defaults, validation naming the field, generation_config defaults, torch-free import; seeds."""

import subprocess
import sys

import pytest

from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.seeds import as_int64, derive_seed, draw_seed


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.logit_bias, p.seed, p.max_tokens, p.min_tokens) == (None, None, 16, 0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == ([], [], False, None)
    assert (p.skip_special_tokens, p.include_stop_str_in_output) == (True, False)
    assert not p.is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("logprobs", -1),
        ("logprobs", 21),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("stop_token_ids", [3, -1]),
        ("stop_token_ids", ["a"]),
        ("stop", [""]),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {3: float("inf")}),
    ],
)
def test_bad_field_raises_value_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_named() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500


@pytest.mark.parametrize(
    "changes",
    [
        {"top_k": -1}, {"top_k": 0}, {"top_p": 1.0}, {"min_p": 0.0}, {"min_p": 1.0}, {"seed": 2**64 - 1},
        {"seed": -(2**63)}, {"logprobs": 0}, {"logprobs": 20}, {"presence_penalty": -2.0},
        {"frequency_penalty": 2.0}, {"max_tokens": None}, {"temperature": 0.0}, {"min_tokens": 16},
    ],
)
def test_edge_values_are_accepted(changes: dict) -> None:
    p = SamplingParams(**changes)
    for name, value in changes.items():
        assert getattr(p, name) == value


def test_stop_accepts_a_string_and_lists_are_not_shared() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    stops = ["a", "b"]
    p = SamplingParams(stop=stops, logit_bias={"7": -100})
    assert p.logit_bias == {7: -100.0}
    stops.append("c")
    q = p.clone(temperature=0.5)
    q.stop.append("d")
    assert p.stop == ["a", "b"] and q.stop == ["a", "b", "d"]
    assert (q.temperature, p.temperature) == (0.5, 1.0)


def test_clone_validates() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams().clone(top_p=0)


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=1e-3, top_k=2).is_greedy


def test_from_generation_config_sets_defaults_and_overrides_win() -> None:
    gen_cfg = {
        "bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
        "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 512, "transformers_version": "4.45.0",
    }
    p = SamplingParams.from_generation_config(gen_cfg)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.6, 0.9, 20, 1.05, 512)
    q = SamplingParams.from_generation_config(gen_cfg, temperature=0.2, max_tokens=8)
    assert (q.temperature, q.top_p, q.max_tokens) == (0.2, 0.9, 8)


def test_from_generation_config_do_sample_false_is_greedy() -> None:
    p = SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.7})
    assert p.temperature == 0 and p.is_greedy
    assert SamplingParams.from_generation_config({}) == SamplingParams()
    assert SamplingParams.from_generation_config({"temperature": None, "top_k": 5}).top_k == 5


def test_from_generation_config_validates() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_generation_config({"top_p": 1.5})


def test_importable_without_torch_and_pydantic() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['pydantic'] = None\n"
        "from deepinfer import SamplingParams\n"
        "from deepinfer.sampling.seeds import draw_seed\n"
        "import deepinfer.sampling\n"
        "p = SamplingParams(temperature=0.5, stop='x', seed=draw_seed())\n"
        "assert p.stop == ['x'] and deepinfer.sampling.SamplingParams is SamplingParams\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_seeds() -> None:
    assert as_int64(2**64 - 1) == -1
    assert as_int64(2**63) == -(2**63)
    assert as_int64(-5) == -5 and as_int64(12) == 12
    drawn = {draw_seed() for _ in range(64)}
    assert len(drawn) == 64 and all(0 <= s < 2**63 for s in drawn)
    assert derive_seed(42, 0) == 42
    derived = [derive_seed(42, i) for i in range(1, 9)]
    assert derived == [derive_seed(42, i) for i in range(1, 9)]
    assert len(set(derived) | {42}) == 9
    assert all(-(2**63) <= s < 2**63 for s in derived)
