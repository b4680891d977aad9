"""KV by layer type through the services (issue #33): `deepinfer up --prefill 0`, the decode worker with
DEEPINFER_DECODE_ENABLE_HYBRID_KV_CACHE=true; every service its own process over a real nats-server, the official
`openai` client. A long prompt, then the same prompt with the answer and one more turn: the second reuses at least
90% of its prompt from the prefix cache, the worker replays at most a window plus a checkpoint interval (its
`worker_kv_replayed_tokens`), and the greedy text is the offline engine's without any cache (float32).

Two models: a tiny random Gemma 3 (window 8, checkpoints every 16 tokens; always), and the registry's Gemma 3 270M
(window 512, checkpoints every 1,024 tokens, a ~4k-token conversation; slow, skipped unless `make gemma3`)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from deepinfer.model_store import GEMMA3_270M
from deepinfer.testing.checkpoints import make_tiny_checkpoint
from deepinfer.up import Stack
from tests.e2e.conftest import STACK_ENV, metrics

pytestmark = pytest.mark.e2e

REPLAYED = "deepinfer_worker_kv_replayed_tokens"
TURN = " Which came last?"


@dataclass(frozen=True)
class Case:
    window: int
    checkpoint_tokens: int
    first: str  # the first prompt
    min_prompt_tokens: int


CASES = {
    # the tiny tokenizer spends about a token a character
    "tiny": Case(8, 16, "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu " * 7, 380),
    "gemma3-270m": Case(512, 1024, " ".join(f"Note {i}: the {['red', 'green', 'blue'][i % 3]} box holds "
                                            f"{i * 7 % 13} stones." for i in range(330)), 4000),
}
GEMMA3_MISSING = importlib.util.find_spec(GEMMA3_270M.package) is None


@pytest.fixture(scope="module", params=[
    "tiny",
    pytest.param("gemma3-270m", marks=[pytest.mark.slow, pytest.mark.skipif(
        GEMMA3_MISSING, reason="Gemma 3 270M is not installed (`make gemma3`)")]),
])
def case(request) -> tuple[str, Case]:
    return request.param, CASES[request.param]


@pytest.fixture(scope="module")
def model(case, tmp_path_factory: pytest.TempPathFactory) -> str:
    name, spec = case
    if name == "tiny":
        return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", sliding_window=spec.window))
    return name


@pytest.fixture(scope="module")
def hybrid_stack(case, model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    _, spec = case
    env = {
        **STACK_ENV,
        "DEEPINFER_DATA_DIR": str(tmp_path_factory.mktemp("data")),
        "DEEPINFER_DECODE_ENABLE_HYBRID_KV_CACHE": "true",
        "DEEPINFER_DECODE_HYBRID_CHECKPOINT_TOKENS": str(spec.checkpoint_tokens),
    }
    with Stack(model=model, port=0, env_overrides=env, start_timeout_s=600, num_prefill=0, num_decode=1) as running:
        yield running


def _complete(client: openai.OpenAI, prompt: str):
    name = client.models.list().data[0].id
    return client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)


def test_a_resent_conversation_hits_its_prefix_and_replays_little(case, model, hybrid_stack):
    from deepinfer import LLM, SamplingParams

    _, spec = case
    client = openai.OpenAI(base_url=hybrid_stack.base_url, api_key="e2e", max_retries=0, timeout=600)
    first = _complete(client, spec.first)
    resent = spec.first + first.choices[0].text + TURN
    second = _complete(client, resent)
    prompt_tokens, cached = second.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens
    assert prompt_tokens >= spec.min_prompt_tokens and cached >= 0.9 * prompt_tokens, second.usage
    assert metrics(hybrid_stack, "decode-0")[REPLAYED] <= spec.window + spec.checkpoint_tokens
    cold = LLM(model, dtype="float32", enable_prefix_caching=False, progress=False)
    text = cold.generate([resent], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    assert second.choices[0].text == text


def test_behind_a_prefill_worker_the_decode_worker_computes_the_prompt(tmp_path_factory):
    """`--prefill 1`: the prefill worker hands over KV in one table for every layer; the hybrid decode worker
    releases it unpulled and computes the prompt itself (decode_requests{kv="recomputed"}): the cold text."""
    from deepinfer import LLM, SamplingParams

    spec = CASES["tiny"]
    model = str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3-pd"), "gemma3", sliding_window=spec.window))
    env = {**STACK_ENV, "DEEPINFER_DATA_DIR": str(tmp_path_factory.mktemp("data-pd")),
           "DEEPINFER_DECODE_ENABLE_HYBRID_KV_CACHE": "true"}
    with Stack(model=model, port=0, env_overrides=env, start_timeout_s=240, num_prefill=1, num_decode=1) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="e2e", max_retries=0, timeout=300)
        got = _complete(client, spec.first).choices[0].text
        recomputed = metrics(stack, "decode-0").get('deepinfer_decode_requests_total{kv="recomputed"}', 0)
    cold = LLM(model, dtype="float32", enable_prefix_caching=False, progress=False)
    want = cold.generate([spec.first], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    assert got == want and recomputed == 1
