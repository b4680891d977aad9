"""Tool calls per model family: how a call looks in the model's output, its grammar, and its parser.

    fmt = tool_format(tokenizer)                      # from the chat template: hermes, llama3 or mistral
    lark = fmt.grammar(tools, parallel, tokenizer)     # tool_choice required / named: the output must be calls
    content, calls = fmt.parse(text)                  # the output as OpenAI tool_calls (none: plain content)

Families: Hermes / Qwen wrap each call in `<tool_call>{"name", "arguments"}</tool_call>`; Llama 3 answers a bare
`{"name", "parameters"}` object (`;` between parallel calls, optionally after `<|python_tag|>`); Mistral starts
with `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`. The two markers are special tokens, dropped from
the text by skip_special_tokens, so those calls are also found by the JSON that opens the output. A template that renders no tools gets the Hermes
form, described in the system message (`template_messages`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from deepinfer.structured.schema import JSON_OPTIONS, prepared_schema
from deepinfer.tokenizer import Tokenizer
from services.gateway.openai_models import FunctionCall, ToolCall

#: A tool without `parameters` takes any JSON object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolFormat:
    """One model family's tool-call syntax."""

    name: str
    #: Text that opens the calls in the output.
    markers: tuple[str, ...]
    #: The markers count only at the start of the output (Llama 3's bare JSON), not after some prose.
    at_start_only: bool
    #: The key holding a call's arguments.
    arguments_key: str
    #: parallel_tool_calls false: only the first call counts.
    single_call: bool = False

    def call_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """The JSON schema of one call to any of `tools` (function dicts: name, parameters)."""
        calls = []
        for function in tools:
            parameters = prepared_schema(function.get("parameters") or _ANY_OBJECT)
            calls.append({
                "type": "object",
                "properties": {"name": {"const": function["name"]}, self.arguments_key: parameters},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            })
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {**schema, "x-guidance": JSON_OPTIONS}

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, tokenizer: Tokenizer) -> str:
        """A Lark grammar (llguidance's dialect) whose sentences are one call, or several when `parallel`."""
        call = json.dumps(self.call_schema(tools))
        if self.name == "hermes":
            many = ' ("\\n" call)*' if parallel else ""
            return f'start: call{many}\ncall: "<tool_call>\\n" args "\\n</tool_call>"\nargs: %json {call}\n'
        if self.name == "llama3":
            many = ' ("; " args)*' if parallel else ""
            return f"start: args{many}\nargs: %json {call}\n"
        opener = _special_or_text(tokenizer, "[TOOL_CALLS]")
        many = ' (", " args)*' if parallel else ""
        return f'start: {opener} "[" args{many} "]"\nargs: %json {call}\n'

    def start(self, text: str) -> int:
        """Where the calls begin in `text` (-1: nowhere yet)."""
        if self.at_start_only:
            stripped = text.lstrip()
            offset = len(text) - len(stripped)
            return offset if any(stripped.startswith(m) for m in self.markers) else -1
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found, default=-1)

    def may_start(self, text: str) -> int:
        """The length of `text` that can be sent as content now: all but a tail that may open a marker."""
        if self.at_start_only:
            stripped = text.lstrip()
            return 0 if not stripped or any(m.startswith(stripped) for m in self.markers) else len(text)
        for keep in range(min(len(text), max(len(m) for m in self.markers)), 0, -1):
            if any(m.startswith(text[-keep:]) for m in self.markers):
                return len(text) - keep
        return len(text)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the calls, the calls); no calls when the output holds none that parse."""
        begin = self.start(text)
        if begin < 0:
            return text, []
        content, body = text[:begin].strip() or None, text[begin:]
        objects = _call_objects(self.name, body)
        calls = [_tool_call(obj, self.arguments_key) for obj in objects]
        if not objects or any(call is None for call in calls):
            return text, []
        found = [c for c in calls if c is not None]
        return content, found[:1] if self.single_call else found


HERMES = ToolFormat("hermes", ("<tool_call>",), at_start_only=False, arguments_key="arguments")
# Llama 3's <|python_tag|> and Mistral's [TOOL_CALLS] are special tokens: skip_special_tokens (the default) drops
# them from the text, so the calls are also recognised by the JSON that starts the output.
LLAMA3 = ToolFormat("llama3", ("<|python_tag|>", "{"), at_start_only=True, arguments_key="parameters")
MISTRAL = ToolFormat("mistral", ("[TOOL_CALLS]", "[{"), at_start_only=True, arguments_key="arguments")


def tool_template(tokenizer: Tokenizer) -> str:
    """The chat template that renders a request with tools ("" when the model has none)."""
    templates = tokenizer.chat_templates
    return templates.get("tool_use") or templates.get("default") or ""


def renders_tools(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template renders `tools` itself."""
    return "tools" in tool_template(tokenizer)


def tool_format(tokenizer: Tokenizer) -> ToolFormat:
    """The family's format, read from the chat template; Hermes when it renders no tools (our own rendering)."""
    template = tool_template(tokenizer)
    if not renders_tools(tokenizer):
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return HERMES


def template_messages(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. A template that renders tools gets them as they are; one that
    does not gets them in the Hermes form: the tools and the call syntax in the system message, earlier calls
    and tool results as text."""
    if renders_tools(tokenizer):
        return [_with_argument_objects(message) for message in messages], tools
    rendered = [_as_text(message) for message in messages]
    if tools:
        prompt = _hermes_system_prompt(tools)
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Earlier calls with their arguments as objects, as Hugging Face templates expect (OpenAI sends JSON text)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    decoded = [
        {**c, "function": {**c["function"], "arguments": _arguments(c)}}
        if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
        for c in calls
    ]
    return {**message, "tool_calls": decoded}


def _hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, answer with a JSON object of its name and arguments inside tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose tool calls or tool result are written out as Hermes text."""
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    written = [
        "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}) + "\n</tool_call>"
        for c in calls if isinstance(c, dict) and isinstance(c.get("function"), dict)
    ]
    if written:
        content = "\n".join([content, *written] if content else written)
    if message.get("role") == "tool":
        content = f"<tool_response>\n{content}\n</tool_response>"
    return {"role": message.get("role", "user"), "content": content}


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call["function"].get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def _special_or_text(tokenizer: Tokenizer, text: str) -> str:
    """A Lark terminal for `text`: the special token by id when the tokenizer has one, else the literal."""
    token_id = tokenizer.token_to_id(text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def _call_objects(family: str, body: str) -> list[Any]:
    """The JSON objects of the calls in `body` (which starts at the marker); [] when they do not parse."""
    try:
        if family == "hermes":
            found = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", body, re.DOTALL)
            return [json.loads(part) for part in found]
        if family == "llama3":
            return _json_sequence(body.strip().removeprefix("<|python_tag|>"), ";")
        listed = json.loads(body.strip().removeprefix("[TOOL_CALLS]"))
        return listed if isinstance(listed, list) else [listed]
    except json.JSONDecodeError:
        return []


def _json_sequence(text: str, separator: str) -> list[Any]:
    """JSON values one after another, `separator` (and whitespace) between them; JSONDecodeError otherwise."""
    decoder, values, at = json.JSONDecoder(), [], 0
    text = text.strip()
    while at < len(text):
        value, at = decoder.raw_decode(text, at)
        values.append(value)
        rest = text[at:].lstrip()
        if rest and not rest.startswith(separator):
            raise json.JSONDecodeError("unexpected text after a call", text, at)
        at = len(text) - len(rest.removeprefix(separator).lstrip())
    return values


def _tool_call(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False)),
    )


class ToolCallBuffer:
    """One streamed choice's text split into content sent at once and the calls held back until the end."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.sent = ""  # content already sent
        self.held = ""  # text that may be (or is) a call

    def feed(self, text: str) -> str:
        """Add text; the part that is surely content, to send now."""
        self.held += text
        if self.fmt.start(self.sent + self.held) >= 0:
            begin = self.fmt.start(self.sent + self.held) - len(self.sent)
            if begin <= 0 or not self.held[:begin].strip():
                return ""  # nothing but whitespace before the call: not content
            ready, self.held = self.held[:begin], self.held[begin:]
        else:
            cut = self.fmt.may_start(self.sent + self.held) - len(self.sent)
            if cut <= 0:
                return ""
            ready, self.held = self.held[:cut], self.held[cut:]
        self.sent += ready
        return ready

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: (content still to send, the calls); unparsable held text goes out as content."""
        held, self.held = self.held, ""
        _, calls = self.fmt.parse(held)
        if not calls:
            return held, []
        return held[: max(self.fmt.start(held), 0)].rstrip(), calls
