"""Speculative decoding through migration and seeded sampling (issue #32), on a stack of its own: 1 prefill and 2
decode workers, both drafting by n-gram prompt lookup (k = 4), every service its own process over a real
nats-server, the official `openai` client. The prompt asks the default model to repeat a text, so most tokens come
from accepted drafts. Greedy and seeded (temperature 0.8) answers equal the offline engine's without speculation
(float32): the engine couples its one-hot drafts to the sampler's own noise per (seed, position), so a draft is kept
exactly when a plain step would have sampled it. The same holds when the decode worker serving a stream is killed
mid-way and the gateway resumes it on the other one: that worker drafts from its own step boundaries, and the text
is still the plain run's."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import openai
import pytest

from deepinfer.up import Stack
from tests.e2e.conftest import STACK_ENV, metrics, wait_until
from tests.e2e.migration import (
    DECODERS,
    admitted,
    assert_resumed,
    both_decoders_up,
    reissues,
    serving,
    stream,
)

pytestmark = pytest.mark.e2e

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill."
REPEAT = [{"role": "user", "content": f"Repeat this text exactly, three times:\n\n{TEXT} {TEXT} {TEXT}"}]
MAX_TOKENS = 64
SPECULATIVE = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, "num_speculative_tokens": 4}
SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 1234}}
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {**STACK_ENV, "DEEPINFER_DATA_DIR": str(tmp_path_factory.mktemp("data")),
           "DEEPINFER_GATEWAY_MIGRATION": "true", "DEEPINFER_GATEWAY_WORKER_LEASE_S": "2",
           "DEEPINFER_DECODE_SPECULATIVE_CONFIG": json.dumps(SPECULATIVE)}
    with Stack(port=0, env_overrides=env, start_timeout_s=240, num_prefill=1, num_decode=2) as running:
        yield running


@pytest.fixture(scope="module")
def client(pair: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=pair.base_url, api_key="e2e", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain() -> dict[str, str]:
    """The offline engine's answers without speculation, float32 as the stack's workers."""
    import torch

    from deepinfer import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(dtype=STACK_ENV["DEEPINFER_DECODE_DTYPE"], progress=False)
    texts = {}
    for name, sampling in SAMPLINGS.items():
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        texts[name] = llm.chat([REPEAT], params, use_tqdm=False)[0].outputs[0].text
    assert TEXT[:20] in texts["greedy"]
    return texts


def _request(pair: Stack, sampling: str) -> dict:
    return {"model": pair.model_name, "messages": REPEAT, "max_tokens": MAX_TOKENS,
            "extra_body": {"ignore_eos": True}, **SAMPLINGS[sampling]}


def _accepted(pair: Stack) -> float:
    return sum(metrics(pair, name).get(ACCEPTED, 0.0) for name in DECODERS)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_speculating_answers_are_the_plain_engine_s_on_every_run(pair, client, plain, sampling):
    before = _accepted(pair)
    texts = [client.chat.completions.create(**_request(pair, sampling)).choices[0].message.content
             for _ in range(2)]
    assert texts == [plain[sampling]] * 2
    # The drafts were verified, and many kept (the counters reach /metrics with the next heartbeat).
    wait_until(lambda: _accepted(pair) - before > 16, 10, "accepted draft tokens on /metrics")


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_a_speculating_stream_survives_its_decode_worker(pair, client, plain, sampling):
    before, victim, admitted_before = reissues(pair), [], admitted(pair)

    def fault() -> None:
        victim.append(serving(pair, admitted_before))
        pair.kill(victim[0], signal.SIGKILL)

    started = time.monotonic()
    streamed = stream(client, _request(pair, sampling), fault)
    assert victim, "the stream ended before the fault"
    assert_resumed(pair, streamed, plain[sampling], MAX_TOKENS, before, started)
    both_decoders_up(pair)


def test_a_required_tool_call_is_the_plain_stack_s(pair, client, stack):
    """Drafts under the tool call's grammar (a forbidden draft token is rejected before verification): the call a
    speculating stack makes is the plain stack's, name and arguments."""
    from tests.e2e.test_structured_output import ASK, WEATHER

    plain_client = openai.OpenAI(base_url=stack.base_url, api_key="e2e", max_retries=0, timeout=120)
    calls = [
        c.chat.completions.create(model=s.model_name, messages=ASK, tools=[WEATHER], tool_choice="required",
                                  temperature=0, max_tokens=64, parallel_tool_calls=False).choices[0]
        for c, s in ((client, pair), (plain_client, stack))
    ]
    assert [c.finish_reason for c in calls] == ["tool_calls", "tool_calls"]
    (speculated,), (plain_call,) = (c.message.tool_calls for c in calls)
    assert (speculated.function.name, json.loads(speculated.function.arguments)) == (
        plain_call.function.name, json.loads(plain_call.function.arguments))
