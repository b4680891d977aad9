"""Anthropic's Messages API over the same pipeline, driven by the official anthropic SDK (async, streaming):
bodies, the streaming event order, stop reasons, usage with cache reads, errors in Anthropic's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anthropic
import httpx2
import pytest

from deepinfer.testing.checkpoints import write_tokenizer_dir
from tests.gateway_harness import ANSWER, MODEL, Harness, make_harness

KEY = "sk-ant"
MESSAGES = [{"role": "user", "content": "Hi there"}]
EVENT_ORDER = ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
               "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture
async def harness(model_dir: Path) -> AsyncIterator[Harness]:
    h = await make_harness(model_dir, settings={"api_keys": [KEY]}, num_cached_tokens=16)
    yield h
    await h.fake.stop()


def _client(h: Harness, key: str = KEY) -> anthropic.AsyncAnthropic:
    """The official SDK on the app (it speaks httpx2, which has its own ASGI transport)."""
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=h.app), base_url="http://gw")
    return anthropic.AsyncAnthropic(base_url="http://gw", api_key=key, http_client=http, max_retries=0)


async def test_a_message_with_a_system_prompt(harness: Harness):
    message = await _client(harness).messages.create(
        model=MODEL, max_tokens=40, system="Be brief.", messages=MESSAGES,
        extra_body={"temperature": 0.5, "top_k": 5},  # older API versions' fields (this SDK no longer names them)
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == ANSWER
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    prompt_ids = harness.tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, *MESSAGES])
    assert harness.fake.prefill_requests[0].prompt_token_ids == prompt_ids
    sampling = harness.fake.prefill_requests[0].sampling
    assert (sampling.temperature, sampling.top_k, sampling.max_tokens) == (0.5, 5, 40)
    assert message.usage.cache_read_input_tokens == 16
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt_ids)
    assert message.usage.output_tokens == len(harness.fake.output_token_ids)


async def test_streaming_events_come_in_anthropics_order(harness: Harness):
    async with _client(harness).messages.stream(model=MODEL, max_tokens=40, messages=MESSAGES) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    assert final.content[0].text == ANSWER and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(harness.fake.output_token_ids)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == ANSWER
    # the wire: every event named, in the documented order (the SDK hides ping)
    async with harness.http() as http:
        raw = await http.post("/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                              json={"model": MODEL, "max_tokens": 40, "messages": MESSAGES, "stream": True})
    names = [line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")]
    collapsed = [name for i, name in enumerate(names) if i == 0 or name != names[i - 1]]
    assert collapsed == EVENT_ORDER, names


async def test_stop_reasons_max_tokens_and_stop_sequence(harness: Harness):
    client = _client(harness)
    cut = await client.messages.create(model=MODEL, max_tokens=3, messages=MESSAGES)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    stopped = await client.messages.create(model=MODEL, max_tokens=40, messages=MESSAGES,
                                           stop_sequences=["nothing", "world"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "world")
    assert stopped.content[0].text == ANSWER[: ANSWER.index("world")]


async def test_a_last_assistant_turn_is_continued(harness: Harness):
    turns = [*MESSAGES, {"role": "assistant", "content": "Well,"}]
    await _client(harness).messages.create(model=MODEL, max_tokens=8, messages=turns)
    expected = harness.tokenizer.encode_chat(turns, add_generation_prompt=False, continue_final_message=True)
    assert harness.fake.prefill_requests[-1].prompt_token_ids == expected


async def test_errors_take_anthropics_shape(harness: Harness):
    client = _client(harness)
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model=MODEL, max_tokens=0, messages=MESSAGES)
    assert bad.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "max_tokens: Input should be greater than or equal to 1"}}
    with pytest.raises(anthropic.BadRequestError, match="thinking is not supported"):
        await client.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError, match="image"):
        await client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="claude-x", max_tokens=8, messages=MESSAGES)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as denied:
        await _client(harness, "sk-wrong").messages.create(model=MODEL, max_tokens=8, messages=MESSAGES)
    assert denied.value.body["error"]["type"] == "authentication_error"
    assert harness.fake.route_requests == []


async def test_overloaded_is_529_and_rate_limits_are_rate_limit_errors(model_dir: Path):
    h = await make_harness(model_dir, overloaded=True)
    with pytest.raises(anthropic.OverloadedError) as overloaded:
        await _client(h).messages.create(model=MODEL, max_tokens=8, messages=MESSAGES)
    assert overloaded.value.status_code == 529 and overloaded.value.response.headers["retry-after"] == "2"
    await h.fake.stop()
    h = await make_harness(model_dir, settings={"api_keys": [KEY], "requests_per_minute": 1})
    await _client(h).messages.create(model=MODEL, max_tokens=8, messages=MESSAGES)
    with pytest.raises(anthropic.RateLimitError) as limited:
        await _client(h).messages.create(model=MODEL, max_tokens=8, messages=MESSAGES)
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    await h.fake.stop()
