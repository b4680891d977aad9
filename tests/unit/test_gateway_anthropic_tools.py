"""Tool use on Anthropic's Messages API over scripted workers, driven by the official anthropic SDK (async,
streaming): tools rendered as the chat route renders them, tool_choice any / tool sending the call grammar, the
output parsed into tool_use blocks (whole and as Anthropic's streaming events), tool_use / tool_result turns giving
the chat route's prompt, and 400s naming what cannot be served."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anthropic
import httpx2
import pytest

from deepinfer.testing.checkpoints import write_tokenizer_dir
from tests.gateway_harness import MODEL, Harness, make_harness

KEY = "sk-ant"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}
OPENAI_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                   "parameters": SCHEMA}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_model_len=2048)


@pytest.fixture
async def harness(model_dir: Path) -> AsyncIterator[Harness]:
    h = await make_harness(model_dir, settings={"api_keys": [KEY]})
    yield h
    await h.fake.stop()


def _client(h: Harness) -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=h.app), base_url="http://gw")
    return anthropic.AsyncAnthropic(base_url="http://gw", api_key=KEY, http_client=http, max_retries=0)


def answer(harness: Harness, text: str) -> None:
    harness.fake.output_token_ids = harness.tokenizer.encode(text, add_special_tokens=False)


def last_prompt(harness: Harness) -> str:
    return harness.tokenizer.decode(harness.fake.decode_requests[-1].prompt_token_ids, skip_special_tokens=False)


async def _raw_events(h: Harness, body: dict) -> list[tuple[str, str]]:
    """(event name, JSON data) of a streamed request, as sent on the wire."""
    async with h.http() as http:
        raw = await http.post("/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                              json={"model": MODEL, "max_tokens": 400, "stream": True, **body})
    lines = raw.text.splitlines()
    return [(line.removeprefix("event: "), lines[i + 1].removeprefix("data: "))
            for i, line in enumerate(lines) if line.startswith("event: ")]


async def test_auto_call_is_a_tool_use_block(harness: Harness):
    answer(harness, CALL_TEXT)
    message = await _client(harness).messages.create(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER])
    assert message.stop_reason == "tool_use"
    (use,) = message.content
    assert use.type == "tool_use" and use.id.startswith("toolu_") and len(use.id) > len("toolu_")
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    assert harness.fake.decode_requests[-1].sampling.grammar is None  # auto: the model may answer in prose
    prompt = last_prompt(harness)
    assert "<tools>" in prompt and "get_weather" in prompt and "The weather in a city" in prompt


async def test_text_before_the_call_is_a_text_block_and_prose_stays_text(harness: Harness):
    client = _client(harness)
    answer(harness, "Let me check. " + CALL_TEXT)
    message = await client.messages.create(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER])
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Let me check." and message.content[1].input == {"city": "Paris"}
    answer(harness, "No call <tool here.")
    prose = await client.messages.create(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER])
    assert [(b.type, b.text) for b in prose.content] == [("text", "No call <tool here.")]
    assert prose.stop_reason == "end_turn"
    answer(harness, '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>')
    not_an_object = await client.messages.create(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER])
    assert not_an_object.content[0].type == "text" and not_an_object.stop_reason == "end_turn"


async def test_any_and_tool_send_the_call_grammar(harness: Harness):
    answer(harness, CALL_TEXT)
    client = _client(harness)
    for tool_choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        message = await client.messages.create(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER],
                                               tool_choice=tool_choice)
        assert message.content[0].name == "get_weather" and message.stop_reason == "tool_use"
        grammar = harness.fake.decode_requests[-1].sampling.grammar
        assert grammar and "<tool_call>" in grammar and grammar == harness.fake.prefill_requests[-1].sampling.grammar


async def test_disable_parallel_tool_use_keeps_the_first_call(harness: Harness):
    answer(harness, CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome"))
    client = _client(harness)
    both = await client.messages.create(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER])
    assert [b.input["city"] for b in both.content] == ["Paris", "Rome"]
    assert len({b.id for b in both.content}) == 2
    one = await client.messages.create(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.input["city"] for b in one.content] == ["Paris"]
    answer(harness, CALL_TEXT)  # the grammar allows one call (a worker sending two breaks it: a 502)
    forced = await client.messages.create(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER],
                                          tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert '("\\n" call)*' not in harness.fake.decode_requests[-1].sampling.grammar  # one call, by the grammar
    assert [b.input["city"] for b in forced.content] == ["Paris"]


async def test_tool_choice_none_renders_no_tools(harness: Harness):
    answer(harness, CALL_TEXT)
    message = await _client(harness).messages.create(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER],
                                                     tool_choice={"type": "none"})
    assert message.content[0].type == "text" and message.content[0].text == CALL_TEXT
    assert "get_weather" not in last_prompt(harness)


async def test_tool_use_and_tool_result_turns_render_as_the_chat_routes(harness: Harness):
    """The same conversation in both APIs gives the workers the same prompt (is_error marks the result)."""
    answer(harness, "It is sunny in Paris.")
    turns = [
        *ASK,
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": '{"sky": "sunny"}'}]},
            {"type": "text", "text": "And tomorrow?"}]},
    ]
    message = await _client(harness).messages.create(model=MODEL, max_tokens=400, messages=turns, tools=[WEATHER],
                                                     system="Be brief.")
    assert message.content[0].text == "It is sunny in Paris." and message.stop_reason == "end_turn"
    anthropic_prompt = harness.fake.decode_requests[-1].prompt_token_ids
    chat = [
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": '{"sky": "sunny"}'},
        {"role": "user", "content": "And tomorrow?"},
    ]
    await harness.openai(KEY).chat.completions.create(model=MODEL, messages=chat, tools=[OPENAI_WEATHER])
    assert harness.fake.decode_requests[-1].prompt_token_ids == anthropic_prompt
    prompt = last_prompt(harness)
    assert '"city": "Paris"' in prompt and '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt
    turns[2]["content"][0] = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such city",
                              "is_error": True}
    await _client(harness).messages.create(model=MODEL, max_tokens=400, messages=turns, tools=[WEATHER])
    assert "<tool_response>\nError: no such city\n</tool_response>" in last_prompt(harness)


async def test_streamed_calls_are_tool_use_blocks_after_the_text(harness: Harness):
    answer(harness, "Let me check. " + CALL_TEXT)
    async with _client(harness).messages.stream(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER]) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].text.strip() == "Let me check." and final.content[1].input == {"city": "Paris"}
    assert final.content[1].id.startswith("toolu_")
    assert "".join(e.partial_json for e in events if e.type == "input_json") == '{"city":"Paris"}'
    # the wire: the text block (0), then the tool_use block (1) opened with an empty input
    names = [(name, data) for name, data in await _raw_events(harness, {"messages": ASK, "tools": [WEATHER]})]
    collapsed = [n for i, (n, _) in enumerate(names) if i == 0 or n != names[i - 1][0]]
    assert collapsed == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                         "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                         "message_stop"], names
    starts = [data for name, data in names if name == "content_block_start"]
    assert '"index":0' in starts[0] and '"type":"text"' in starts[0]
    assert '"index":1' in starts[1] and '"type":"tool_use"' in starts[1] and '"input":{}' in starts[1]
    assert any('"type":"input_json_delta"' in data and '"index":1' in data for _, data in names)
    assert '"stop_reason":"tool_use"' in next(data for name, data in names if name == "message_delta")


async def test_streamed_forced_call_and_streamed_prose(harness: Harness):
    answer(harness, CALL_TEXT)
    client = _client(harness)
    async with client.messages.stream(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER],
                                      tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == {"city": "Paris"}
    names = [name for name, _ in await _raw_events(harness, {"messages": ASK, "tools": [WEATHER],
                                                             "tool_choice": {"type": "any"}})]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    answer(harness, "No call <tool here.")
    async with client.messages.stream(model=MODEL, max_tokens=400, messages=ASK, tools=[WEATHER]) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "No call <tool here." and final.stop_reason == "end_turn"


@pytest.mark.parametrize(("fields", "words"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking is not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "bad name!", "input_schema": SCHEMA}]}, "tools.0.name"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tool_choice": {"type": "any"}}, "tool_choice requires tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "needs a name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "'nope', which is not in tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "required"}}, "tool_choice.type"),
    ({"tools": [{"name": "f", "input_schema": {"not": {}}}], "tool_choice": {"type": "any"}}, "tools"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, "tool_result blocks belong in user"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "tool_use blocks belong in assistant"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}]}, "image"),
])
async def test_what_cannot_be_served_is_a_400_naming_it(harness: Harness, fields: dict, words: str):
    body = {"model": MODEL, "max_tokens": 8, "messages": ASK, **fields}
    async with harness.http() as http:
        response = await http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]
    assert harness.fake.route_requests == []  # refused before any worker saw it
