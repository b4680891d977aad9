"""Structured output and tool calls through the whole stack (prefill → decode split) with the official openai SDK:
20 varied JSON schemas parse and validate, a tool round trip, tool_choice required / named always call."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e


def _obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False, **extra}


NAME = {"type": "string", "maxLength": 12}
SCHEMAS: list[tuple[str, dict]] = [
    ("A person: name and age.", _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("Is the sky blue?", _obj({"answer": {"type": "boolean"}})),
    ("Pick a colour.", _obj({"colour": {"enum": ["red", "green", "blue"]}})),
    ("A city and its country.", _obj({"city": NAME, "country": NAME})),
    ("Three small numbers.", _obj({"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9},
                                               "minItems": 3, "maxItems": 3}})),
    ("A book with an author.", _obj({"title": NAME, "author": _obj({"first": NAME, "last": NAME})})),
    ("A product code.", _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}})),
    ("A constant version.", _obj({"version": {"const": 2}, "name": NAME})),
    ("A temperature in Celsius.", _obj({"celsius": {"type": "integer", "minimum": -50, "maximum": 50}})),
    ("A status, maybe missing.", _obj({"status": {"type": ["string", "null"], "maxLength": 8}})),
    ("An id, number or text.", _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                                      {"type": "string", "maxLength": 6}]}})),
    ("A point.", {"$defs": {"coord": {"type": "integer", "minimum": -9, "maximum": 9}},
                  **_obj({"x": {"$ref": "#/$defs/coord"}, "y": {"$ref": "#/$defs/coord"}})}),
    ("Two tags.", _obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2}})),
    ("A user with optional email.", _obj({"user": NAME, "email": {"type": "string", "maxLength": 20}},
                                         required=["user"])),
    ("A yes/no vote with a count.", _obj({"vote": {"enum": ["yes", "no"]},
                                          "count": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("A list of two people.", _obj({"people": {"type": "array", "items": _obj({"name": NAME}), "maxItems": 2}})),
    ("A weekday.", {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri"]}),
    ("A small integer.", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("A short greeting.", _obj({"greeting": {"type": "string", "minLength": 2, "maxLength": 10}})),
    ("An order: item, quantity, gift?", _obj({"item": NAME, "quantity": {"type": "integer", "minimum": 1,
                                                                         "maximum": 9},
                                              "gift": {"type": "boolean"}})),
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": _obj({"city": {"type": "string", "maxLength": 16}}),
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _ask(prompt: str) -> list[dict]:
    return [{"role": "user", "content": f"Answer in JSON. {prompt}"}]


@pytest.mark.parametrize(("prompt", "schema"), SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_json_schema_output_validates(client: openai.OpenAI, stack, prompt: str, schema: dict):
    reply = client.chat.completions.create(
        model=stack.model_name, messages=_ask(prompt), temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content  # the grammar completed and stopped it
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_streams_an_object(client: openai.OpenAI, stack):
    stream = client.chat.completions.create(
        model=stack.model_name, messages=_ask("A cat with a name."), temperature=0.7, seed=5, max_tokens=64,
        response_format={"type": "json_object"}, stream=True,
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # out of tokens inside a string: still the start of an object
        assert chunks[-1].choices[0].finish_reason == "length" and text.startswith("{")


def test_unsupported_schema_is_a_400(client: openai.OpenAI, stack):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=stack.model_name, messages=_ask("x"), max_tokens=8,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "out", "schema": {"not": {"type": "string"}}}},
        )
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    assert "not" in caught.value.body["message"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_round_trip(client: openai.OpenAI, stack, tool_choice):
    first = client.chat.completions.create(
        model=stack.model_name, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, temperature=0,
        max_tokens=64, parallel_tool_calls=False,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "celsius": 21})},
    ]
    answer = client.chat.completions.create(
        model=stack.model_name, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=32,
    )
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_required_tool_call_streams_as_deltas(client: openai.OpenAI, stack):
    stream = client.chat.completions.create(
        model=stack.model_name, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0.8, seed=1,
        max_tokens=64, stream=True, parallel_tool_calls=False,
    )
    names, arguments, finish = [], "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            names.append(call.function.name)
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and names == ["get_weather"]
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
