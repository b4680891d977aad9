"""The gateway's side of structured output over scripted workers: the grammar sent to the workers, 400s naming
the field for schemas and tool choices it cannot enforce, the output re-checked against the grammar, and tool
calls parsed (whole and streamed) with the template's tool rendering."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from deepinfer.testing.checkpoints import write_tokenizer_dir
from tests.gateway_harness import MODEL, Harness, make_harness

MESSAGES = [{"role": "user", "content": "Hi there"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_model_len=2048)


@pytest.fixture
async def harness(model_dir: Path) -> AsyncIterator[Harness]:
    h = await make_harness(model_dir)
    yield h
    await h.fake.stop()


def answer(harness: Harness, text: str) -> None:
    harness.fake.output_token_ids = harness.tokenizer.encode(text, add_special_tokens=False)


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


async def test_json_schema_grammar_reaches_prefill_and_decode(harness: Harness):
    answer(harness, '{"a": 12}')
    client = harness.openai()
    result = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=json_schema(SCHEMA), max_tokens=40
    )
    assert json.loads(result.choices[0].message.content) == {"a": 12}
    assert result.choices[0].finish_reason == "stop"
    (prefill,), (decode,) = harness.fake.prefill_requests, harness.fake.decode_requests
    assert prefill.sampling.grammar and prefill.sampling.grammar == decode.sampling.grammar
    assert "json_schema" in decode.sampling.grammar


async def test_json_object_and_text(harness: Harness):
    answer(harness, '{"x": [1, "y"]}')
    client = harness.openai()
    result = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=40
    )
    assert json.loads(result.choices[0].message.content) == {"x": [1, "y"]}
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "text"})
    assert harness.fake.decode_requests[-1].sampling.grammar is None


async def test_output_that_breaks_the_grammar_is_an_error_not_a_200(harness: Harness):
    answer(harness, "Hello, world!")  # a worker that ignored the grammar (an older build drops unknown fields)
    client = harness.openai()
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"})
    assert caught.value.status_code == 502 and "format" in caught.value.message
    answer(harness, '{"a": 1')  # stopped before the object closed
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"})
    assert caught.value.status_code == 502


@pytest.mark.parametrize(("response_format", "param", "words"), [
    (json_schema({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
     "response_format.json_schema.schema", "not"),
    (json_schema({"type": "string", "format": "color"}), "response_format.json_schema.schema", "format"),
    (json_schema({"$ref": "#/definitions/missing"}), "response_format.json_schema.schema", "missing"),
    (json_schema({"type": "object", "description": "x" * 40_000}), "response_format.json_schema.schema", "bytes"),
    # issue #40: schemas no finite document satisfies, and grammars past the limits (refused before routing)
    (json_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
     "response_format.json_schema.schema", "no finite JSON document satisfies the schema: #/$defs/a requires itself"),
    (json_schema({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}),
     "response_format.json_schema.schema", "#/properties/next requires # again"),
    (json_schema({"type": "string", "pattern": "^a{100000}$"}), "response_format.json_schema.schema",
     "exceeds this server's limits"),
    (json_schema({"type": "string", "pattern": "^(x{1000}){1000}$"}), "response_format.json_schema.schema",
     "exceeds this server's limits"),
    (json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "response_format.json_schema.schema",
     "minimum (5) is greater than maximum (1)"),
    ({"type": "json_schema"}, "response_format", "json_schema"),
    ({"type": "yaml"}, "response_format.type", ""),
])
async def test_schemas_that_cannot_be_enforced_are_400s_naming_the_field(
    harness: Harness, response_format: dict, param: str, words: str
):
    async with harness.http() as http:
        body = {"model": MODEL, "messages": MESSAGES, "response_format": response_format}
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]
    assert "<state>" not in response.text and "compute_time_us" not in response.text
    assert "\n" not in error["message"] and len(error["message"]) < 300
    assert harness.fake.route_requests == []  # refused before any worker saw it


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/x"}}, "required": ["x"],
        "$defs": {"x": {"$ref": "#/$defs/x"}}}}}], "tool_choice": "required"}, "tools"),
])
async def test_tool_choices_that_cannot_be_met_are_400s(harness: Harness, fields: dict, param: str):
    async with harness.http() as http:
        response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_auto_tool_call_is_parsed_and_the_tools_are_in_the_prompt(harness: Harness):
    answer(harness, CALL_TEXT)
    client = harness.openai()
    result = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    (decode,) = harness.fake.decode_requests
    assert decode.sampling.grammar is None  # auto: the model may answer in prose
    prompt = harness.tokenizer.decode(decode.prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and "get_weather" in prompt  # the tiny template renders no tools: ours does


async def test_required_and_named_send_the_call_grammar(harness: Harness):
    answer(harness, CALL_TEXT)
    client = harness.openai()
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        result = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False
        )
        assert result.choices[0].message.tool_calls[0].function.name == "get_weather"
        assert "<tool_call>" in harness.fake.decode_requests[-1].sampling.grammar


async def test_prose_with_tools_stays_content(harness: Harness):
    answer(harness, "No call <tool here.")
    client = harness.openai()
    result = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])
    assert result.choices[0].message.content == "No call <tool here."
    assert result.choices[0].message.tool_calls is None and result.choices[0].finish_reason == "stop"
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert text == "No call <tool here."


async def test_streamed_tool_calls_arrive_as_deltas(harness: Harness):
    answer(harness, "Checking. " + CALL_TEXT)
    client = harness.openai()
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], stream=True)
    content, calls, finish = "", {}, None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content.strip() == "Checking."
    assert finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("call_")


async def test_tool_round_trip_messages_render(harness: Harness):
    answer(harness, "It is sunny in Paris.")
    client = harness.openai()
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    result = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert result.choices[0].message.content == "It is sunny in Paris."
    prompt = harness.tokenizer.decode(harness.fake.decode_requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert '"city": "Paris"' in prompt and '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt


async def test_tool_choice_none_renders_no_tools_and_parses_nothing(harness: Harness):
    answer(harness, CALL_TEXT)
    client = harness.openai()
    result = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="none")
    assert result.choices[0].message.content == CALL_TEXT and result.choices[0].message.tool_calls is None
    prompt = harness.tokenizer.decode(harness.fake.decode_requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "get_weather" not in prompt


async def test_completions_take_response_format_too(harness: Harness):
    answer(harness, '{"a": 3}')
    client = harness.openai()
    result = await client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=20, extra_body={"response_format": json_schema(SCHEMA)}
    )
    assert json.loads(result.choices[0].text) == {"a": 3}
    assert "json_schema" in harness.fake.decode_requests[-1].sampling.grammar
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt="JSON:", extra_body={
            "response_format": json_schema({"not": {}})})


async def test_parallel_tool_calls_false_keeps_the_first_call(harness: Harness):
    answer(harness, CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome"))
    client = harness.openai()
    both = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Paris", "Rome"]
    one = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                               parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]
