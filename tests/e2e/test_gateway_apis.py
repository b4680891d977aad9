"""The gateway's other API shapes on the running stack (every service its own process, the default model on the
CPU): Anthropic's Messages API through the official anthropic SDK (whole and streamed, the same tokens as the
OpenAI route; a tool_use → tool_result round trip, a streamed tool_use block), vLLM's /tokenize and /detokenize,
x-request-id, and hostile input answered while serving."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from deepinfer.up import Stack

pytestmark = pytest.mark.e2e
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def claude(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url.removesuffix("/v1"), api_key="e2e", max_retries=0,
                               timeout=60)


def test_anthropic_messages_give_the_openai_routes_tokens(claude, client: openai.OpenAI, stack: Stack):
    greedy = {"temperature": 0.0}
    message = claude.messages.create(model=stack.model_name, max_tokens=12, messages=QUESTION, extra_body=greedy)
    chat = client.chat.completions.create(model=stack.model_name, messages=QUESTION, max_tokens=12, **greedy)
    assert message.content[0].text == chat.choices[0].message.content
    assert "Paris" in message.content[0].text
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    with claude.messages.stream(model=stack.model_name, max_tokens=12, messages=QUESTION,
                                extra_body=greedy) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text and final.stop_reason == message.stop_reason


def test_tokenize_detokenize_and_request_ids(stack: Stack):
    root = stack.base_url.removesuffix("/v1")
    tokens = httpx.post(f"{root}/tokenize", json={"messages": QUESTION}, headers={"x-request-id": "e2e-1"},
                        timeout=30)
    assert tokens.status_code == 200 and tokens.headers["x-request-id"] == "e2e-1"
    body = tokens.json()
    assert body["count"] == len(body["tokens"]) > 5 and body["max_model_len"] > body["count"]
    text = httpx.post(f"{root}/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()["prompt"]
    assert "capital of France" in text


def test_hostile_input_is_a_400_and_the_stack_still_serves(client: openai.OpenAI, stack: Stack):
    root = stack.base_url.removesuffix("/v1")
    nested = b'{"model": "x", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    for body in (nested, b'{"model": "x", "prompt": "\\ud800"}'):
        response = httpx.post(f"{root}/v1/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="chat templates in requests are refused"):
        client.chat.completions.create(model=stack.model_name, messages=QUESTION, max_tokens=2,
                                       extra_body={"chat_template": "{{ 'a' * 200000000 }}"})
    answer = client.chat.completions.create(model=stack.model_name, messages=QUESTION, max_tokens=12,
                                            temperature=0.0)
    assert "Paris" in answer.choices[0].message.content


WEATHER_TOOL = {
    "name": "get_weather", "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                     "required": ["city"], "additionalProperties": False},
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_tool_round_trip(claude, stack: Stack, tool_choice: dict):
    """tool_choice any / tool → a tool_use block → a tool_result turn → an answer in text."""
    first = claude.messages.create(
        model=stack.model_name, max_tokens=64, messages=WEATHER_ASK, tools=[WEATHER_TOOL],
        tool_choice={**tool_choice, "disable_parallel_tool_use": True}, extra_body={"temperature": 0.0},
    )
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_TOOL["input_schema"])
    turns = [
        *WEATHER_ASK,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": json.dumps({"sky": "sunny", "celsius": 21})}]},
    ]
    answer = claude.messages.create(model=stack.model_name, max_tokens=32, messages=turns, tools=[WEATHER_TOOL],
                                    tool_choice={"type": "none"}, extra_body={"temperature": 0.0})
    assert [block.type for block in answer.content] == ["text"] and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_forced_tool_use_streams_as_a_tool_use_block(claude, stack: Stack):
    with claude.messages.stream(model=stack.model_name, max_tokens=64, messages=WEATHER_ASK, tools=[WEATHER_TOOL],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body={"temperature": 0.8}) as stream:
        partial = "".join(event.partial_json for event in stream if event.type == "input_json")
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert json.loads(partial) == final.content[0].input
    jsonschema.validate(final.content[0].input, WEATHER_TOOL["input_schema"])
