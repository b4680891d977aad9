"""Speculative decoding through the services (issue #32): a stack of its own per config (1 prefill + 1 decode
worker, every service its own process over a real nats-server, the official `openai` client), the decode worker
drafting by n-gram prompt lookup with a fixed k and with "auto" (also with async scheduling, as a CUDA worker runs
it), and by suffix decoding with "auto". A request that asks the default model to repeat
a text drafts well, so most of its tokens come from accepted runs: the gateway's text is the offline engine's
without speculation (float32, greedy), a stop string and max_tokens inside an accepted run cut it where a plain
run would, a JSON-schema request drafts under its grammar, and the decode worker's /metrics counts the drafts."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from deepinfer.up import Stack
from tests.e2e.conftest import STACK_ENV, metrics, wait_until

pytestmark = pytest.mark.e2e

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill."
REPEAT = [{"role": "user", "content": f"Repeat this text exactly, twice:\n\n{TEXT} {TEXT}"}]
NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
CONFIGS = {"k4": {**NGRAM, "num_speculative_tokens": 4}, "auto": {**NGRAM, "num_speculative_tokens": "auto"},
           "suffix": {"method": "suffix", "num_speculative_tokens": "auto"},
           # async scheduling as a CUDA worker has it by default: plain steps async, verify steps synchronous
           "auto-async": {**NGRAM, "num_speculative_tokens": "auto"}}
SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}
#: The decode worker's acceptance counters (vLLM's names).
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
ITL_COUNT = 'deepinfer_gateway_itl_seconds_count{route="chat"}'


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def spec_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        **STACK_ENV,
        "DEEPINFER_DATA_DIR": str(tmp_path_factory.mktemp("data")),
        "DEEPINFER_DECODE_SPECULATIVE_CONFIG": json.dumps(CONFIGS[request.param]),
    }
    if request.param.endswith("-async"):
        env["DEEPINFER_DECODE_ASYNC_SCHEDULING"] = "true"
    with Stack(port=0, env_overrides=env, start_timeout_s=240, num_prefill=1, num_decode=1) as running:
        running.spec_config = CONFIGS[request.param]
        yield running


@pytest.fixture(scope="module")
def client(spec_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=spec_stack.base_url, api_key="e2e", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def plain_llm():
    """The offline engine without speculation, float32 as the stack's workers: the reference."""
    import torch

    from deepinfer import LLM

    torch.set_num_threads(1)
    return LLM(dtype=STACK_ENV["DEEPINFER_DECODE_DTYPE"], progress=False)


def _offline(llm, messages, **params):
    from deepinfer import SamplingParams

    out = llm.chat([messages], SamplingParams(temperature=0, **params), use_tqdm=False)[0].outputs[0]
    return out.text, out.finish_reason, len(out.token_ids)


def _drafts_every_step(stack: Stack) -> bool:
    """Whether the stack verifies drafts whatever a step costs: a fixed num_speculative_tokens. With "auto" the draft
    controller decides from measured step times (engine/draft_controller.py), so on a busy machine it may verify
    none of a short request's drafts; its text is the plain run's either way, which is what every config is held to."""
    return isinstance(stack.spec_config.get("num_speculative_tokens"), int)


def _accepted(stack: Stack) -> tuple[float, float]:
    samples = metrics(stack, "decode-0")
    return samples.get(DRAFTS, 0.0), samples.get(ACCEPTED, 0.0)


def test_greedy_text_is_the_plain_run_s_streamed_or_not(client, spec_stack, plain_llm):
    want = _offline(plain_llm, REPEAT, max_tokens=64)
    assert TEXT[:20] in want[0]
    before = _accepted(spec_stack)
    itl_before = metrics(spec_stack, "gateway-0").get(ITL_COUNT, 0.0)
    reply = client.chat.completions.create(
        model=spec_stack.model_name, messages=REPEAT, temperature=0, max_tokens=64
    )
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason, reply.usage.completion_tokens) == want
    text, finishes = "", []
    for chunk in client.chat.completions.create(
        model=spec_stack.model_name, messages=REPEAT, temperature=0, max_tokens=64, stream=True
    ):
        for c in chunk.choices:
            text += c.delta.content or ""
            finishes += [c.finish_reason] if c.finish_reason else []
    assert (text, finishes) == (want[0], [want[1]])
    # The gateway's ITL counts each token after a choice's first delivery once, drafted runs' tokens too (they
    # arrive together and share their gap): per request at most n - 1 of its n tokens, and at least n - the first
    # delivery's <= 5 (k + 1) tokens - a few the detokenizer held.
    itl_observations, num_tokens = metrics(spec_stack, "gateway-0")[ITL_COUNT] - itl_before, want[2]
    assert 2 * (num_tokens - 8) <= itl_observations <= 2 * (num_tokens - 1)
    # The counters reach /metrics with the worker's next heartbeat. Many of the 2 x 64 tokens came from drafts.
    fixed_k = _drafts_every_step(spec_stack)
    if fixed_k:
        wait_until(lambda: _accepted(spec_stack)[1] - before[1] > 16, 10, "accepted draft tokens on /metrics")
    samples = metrics(spec_stack, "decode-0")  # one scrape for every check below
    if fixed_k:
        assert samples.get(DRAFTS, 0.0) > before[0]
        assert samples['vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert samples.get("vllm:spec_decode_num_draft_tokens_total", 0.0) >= samples.get(ACCEPTED, 0.0)


def test_a_stop_string_and_max_tokens_inside_an_accepted_run_cut_as_a_plain_run(
    client, spec_stack, plain_llm
):
    # "lazy" comes in the repeated text, well after the first tokens: its run of tokens was drafted.
    stopped = _offline(plain_llm, REPEAT, stop=["lazy"], max_tokens=64)
    assert stopped[0].endswith("over the ") and stopped[1] == "stop"
    before = _accepted(spec_stack)[1]
    reply = client.chat.completions.create(
        model=spec_stack.model_name, messages=REPEAT, temperature=0, stop=["lazy"], max_tokens=64
    )
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == stopped[:2]
    if _drafts_every_step(spec_stack):
        wait_until(lambda: _accepted(spec_stack)[1] > before, 10, "accepted drafts of the stopped request")
    cut = _offline(plain_llm, REPEAT, max_tokens=13)
    reply = client.chat.completions.create(
        model=spec_stack.model_name, messages=REPEAT, temperature=0, max_tokens=13
    )
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason, reply.usage.completion_tokens) == cut


def test_a_json_schema_request_drafts_under_its_grammar(client, spec_stack, plain_llm):
    from deepinfer.structured import json_schema_grammar

    messages = [
        {
            "role": "user",
            "content": f'Answer in JSON with the key "text": repeat this text exactly.\n\n{TEXT}',
        }
    ]
    want = _offline(plain_llm, messages, max_tokens=64, grammar=json_schema_grammar(SCHEMA))
    before = _accepted(spec_stack)
    reply = client.chat.completions.create(
        model=spec_stack.model_name,
        messages=messages,
        temperature=0,
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": SCHEMA, "strict": True},
        },
    )
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == want[:2]
    assert json.loads(want[0]).keys() == {"text"}
    if _drafts_every_step(spec_stack):
        wait_until(lambda: _accepted(spec_stack)[1] > before[1], 10, "accepted drafts of the JSON request")
