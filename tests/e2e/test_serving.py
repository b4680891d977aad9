"""The whole stack with the default model: answers, prefix cache, handoff correctness, cancellation."""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import metrics, wait_until

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG_CONTEXT = " ".join(
    f"Fact {i}: the river number {i} flows into lake {i * 7 % 13}, which borders the town of Tarn-{i}."
    for i in range(20)
)


def test_default_model_answers_paris(client, stack):
    reply = client.chat.completions.create(model=stack.model_name, messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens_details.cached_tokens is not None
    stream = client.chat.completions.create(
        model=stack.model_name, messages=QUESTION, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None


def test_same_long_prompt_twice_hits_the_prefix_cache(client, stack):
    messages = [{"role": "system", "content": LONG_CONTEXT}, {"role": "user", "content": "Which town is river 3 near?"}]
    first = client.chat.completions.create(model=stack.model_name, messages=messages, temperature=0, max_tokens=16)
    second = client.chat.completions.create(model=stack.model_name, messages=messages, temperature=0, max_tokens=16)
    prompt_tokens = second.usage.prompt_tokens
    assert prompt_tokens > 300
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content


def test_disaggregated_tokens_equal_offline_engine(client, stack, offline_llm):
    from deepinfer import SamplingParams

    prompts = [
        [{"role": "user", "content": "Write a short poem about the sea."}],
        [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline_llm.chat(prompts, params, use_tqdm=False)]
    for messages, text in zip(prompts, expected, strict=True):
        reply = client.chat.completions.create(
            model=stack.model_name, messages=messages, temperature=0, max_tokens=40, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 40
        assert reply.choices[0].message.content == text


def test_client_disconnect_releases_everything(client, stack):
    stream = client.chat.completions.create(
        model=stack.model_name, messages=QUESTION, temperature=0.7, max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True},
    )
    for received, _chunk in enumerate(stream, start=1):
        if received >= 5:
            break
    stream.close()
    started = time.monotonic()

    def idle() -> bool:
        decode, prefill = metrics(stack, "decode-0"), metrics(stack, "prefill-0")
        return (
            decode["deepinfer_worker_running_requests"] == 0
            and decode["deepinfer_worker_waiting_requests"] == 0
            and decode["deepinfer_worker_free_blocks"] == decode["deepinfer_worker_total_blocks"]
            and prefill["deepinfer_worker_held_leases"] == 0
            and prefill["deepinfer_worker_free_blocks"] == prefill["deepinfer_worker_total_blocks"]
        )

    wait_until(idle, 10, "the workers to drop the cancelled request")
    assert time.monotonic() - started < 10
