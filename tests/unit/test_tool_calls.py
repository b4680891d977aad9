"""Tool-call formats per model family: parsing, the streamed split, the call grammars and the family's choice."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from deepinfer.structured import Grammars
from deepinfer.testing.checkpoints import write_tokenizer_dir
from deepinfer.tokenizer import Tokenizer
from services.gateway.tool_calls import (
    HERMES,
    LLAMA3,
    MISTRAL,
    ToolCallBuffer,
    ToolFormat,
    template_messages,
    tool_format,
)

TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                           "required": ["city"], "additionalProperties": False}},
    {"name": "now"},
]
CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]',
}
FORMATS = {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("family", sorted(CALLS))
def test_each_family_parses_its_parallel_calls(family: str):
    content, calls = FORMATS[family].parse(CALLS[family])
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("now", {})
    ]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("family", sorted(CALLS))
def test_each_family_grammar_accepts_its_calls_and_only_named_tools(family: str, tokenizer: Tokenizer):
    grammars = Grammars(tokenizer)
    fmt = FORMATS[family]
    grammar = llguidance.LLMatcher.grammar_from_lark(fmt.grammar(TOOLS, True, tokenizer))
    grammars.check(grammar)
    matcher = grammars.matcher(grammar)
    assert matcher.accept_all(tokenizer.encode(CALLS[family], add_special_tokens=False))
    assert matcher.is_accepting
    single = grammars.matcher(llguidance.LLMatcher.grammar_from_lark(fmt.grammar(TOOLS[:1], False, tokenizer)))
    assert not single.accept_all(tokenizer.encode(CALLS[family], add_special_tokens=False))  # "now" is not allowed


def test_text_that_is_not_a_call_stays_content():
    assert HERMES.parse("plain answer") == ("plain answer", [])
    assert HERMES.parse("<tool_call>\n{not json}\n</tool_call>") == ("<tool_call>\n{not json}\n</tool_call>", [])
    assert LLAMA3.parse("Sure: {} is empty") == ("Sure: {} is empty", [])
    without_marker = CALLS["mistral"].removeprefix("[TOOL_CALLS]")  # the special token skipped from the text
    assert [c.function.name for c in MISTRAL.parse(without_marker)[1]] == ["get_weather", "now"]
    assert MISTRAL.parse("See [{1}]") == ("See [{1}]", [])
    content, calls = HERMES.parse("Let me look. " + CALLS["hermes"])
    assert content == "Let me look." and len(calls) == 2


@pytest.mark.parametrize("pieces", [
    ["Let me ", "look. <to", "ol_call>\n", '{"name": "now", "arguments": {}}', "\n</tool_call>"],
    ["Let me look. <tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"],
])
def test_stream_buffer_sends_content_and_holds_the_call(pieces: list[str]):
    buffer = ToolCallBuffer(HERMES)
    sent = "".join(buffer.feed(piece) for piece in pieces)
    rest, calls = buffer.finish()
    assert (sent + rest).strip() == "Let me look."
    assert [c.function.name for c in calls] == ["now"]


@pytest.mark.parametrize(("fmt", "pieces"), [
    (MISTRAL, [" ", "[", '{"name": "now", ', '"arguments": {}}]']),
    (LLAMA3, ["{", '"name": "now", "parameters": {}}']),
])
def test_stream_buffer_holds_a_call_that_opens_the_output(fmt: ToolFormat, pieces: list[str]):
    buffer = ToolCallBuffer(fmt)
    assert "".join(buffer.feed(piece) for piece in pieces) == ""
    rest, calls = buffer.finish()
    assert rest == "" and [c.function.name for c in calls] == ["now"]
    prose = ToolCallBuffer(fmt)  # a false start is held, then goes out; at the end, unparsable held text too
    sent = prose.feed("[")
    assert sent == ("" if fmt is MISTRAL else "[")
    sent += prose.feed("1, 2] {") + prose.feed("}")
    assert sent + prose.finish()[0] == "[1, 2] {}"


def test_stream_buffer_releases_a_false_start():
    buffer = ToolCallBuffer(HERMES)
    assert buffer.feed("a <tool") == "a "
    assert buffer.feed("kit") == "<toolkit"
    assert buffer.finish() == ("", [])


@pytest.mark.parametrize(("template", "expected"), [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", HERMES),  # renders no tools: our Hermes rendering
    ("{{ tools }} <tool_call>", HERMES),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", MISTRAL),
    ("{% if tools %}{{ tools }}{% endif %}<|python_tag|>ipython", LLAMA3),
])
def test_family_is_read_from_the_chat_template(tmp_path: Path, template: str, expected: ToolFormat):
    model_dir = write_tokenizer_dir(tmp_path)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert tool_format(Tokenizer.from_dir(model_dir)) is expected


QWEN_STYLE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def test_a_template_that_renders_tools_gets_them_with_argument_objects(tmp_path: Path):
    model_dir = write_tokenizer_dir(tmp_path)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN_STYLE}))
    tokenizer = Tokenizer.from_dir(model_dir)
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}
    messages = [{"role": "user", "content": "time?"}, {"role": "assistant", "tool_calls": [call]}]
    tools = [{"type": "function", "function": TOOLS[1]}]
    rendered, passed = template_messages(tokenizer, messages, tools)
    assert passed == tools and rendered[1]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    text = tokenizer.apply_chat_template(rendered, tools=passed)
    assert '<tool_call>{"name": "now", "arguments": {"tz": "UTC"}}</tool_call>' in text and '"now"' in text
    assert tool_format(tokenizer) is HERMES


def test_mistral_grammar_opens_with_the_special_token_when_there_is_one(tmp_path: Path):
    model_dir = write_tokenizer_dir(tmp_path)
    tokenizer = Tokenizer.from_dir(model_dir)
    tokenizer.backend.add_special_tokens(["[TOOL_CALLS]"])
    marker = tokenizer.token_to_id("[TOOL_CALLS]")
    assert marker is not None
    lark = MISTRAL.grammar(TOOLS, False, tokenizer)
    assert lark.startswith(f"start: <[{marker}]>")
    grammars = Grammars(tokenizer)
    matcher = grammars.matcher(llguidance.LLMatcher.grammar_from_lark(lark))
    call = tokenizer.encode('[{"name": "now", "arguments": {}}]', add_special_tokens=False)
    assert matcher.accept_all([marker, *call]) and matcher.is_accepting
    text = tokenizer.decode([marker, *call])  # skip_special_tokens: the marker is gone
    assert [c.function.name for c in MISTRAL.parse(text)[1]] == ["now"]
