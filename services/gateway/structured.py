"""What a chat request asks of its output: `response_format` and `tools` / `tool_choice` → a grammar the workers
enforce while decoding, and the tool-call parsing the presenter applies after.

    rules = output_rules(model, body)     # 400 naming the field for a bad or unsupported schema; None: free text
    sampling = rules.apply(sampling)      # the grammar travels in WireSamplingParams
    checker = rules.checker(model)        # per choice: the output's tokens re-checked against the grammar

| request                                   | grammar (workers)            | parsed into tool_calls |
|-------------------------------------------|------------------------------|------------------------|
| response_format json_object / json_schema | that JSON                    | no                     |
| tools, tool_choice auto (the default)     | none                         | when the output calls  |
| tools, tool_choice required / named       | one call (or several) of it  | yes                    |
| tool_choice none                          | none (tools not rendered)    | no                     |
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import llguidance

from deepinfer.protocol import WireSamplingParams
from deepinfer.structured import (
    GrammarError,
    GrammarMatcher,
    SchemaError,
    json_object_grammar,
    json_schema_grammar,
)
from deepinfer.structured.schema import schema_error
from services.gateway.errors import ApiError, bad_request
from services.gateway.openai_models import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from services.gateway.recipe import ModelInfo
from services.gateway.tool_calls import ToolFormat, tool_format

#: Where a response_format schema sits in the body (errors name it in `param`).
_SCHEMA_PARAM = "response_format.json_schema.schema"


@dataclass(frozen=True)
class OutputRules:
    """The grammar the output must follow (None: free), and the tool format to parse it with (None: no tools)."""

    grammar: str | None
    tools: ToolFormat | None

    def apply(self, sampling: WireSamplingParams) -> WireSamplingParams:
        """The sampling params carrying the grammar."""
        return sampling.model_copy(update={"grammar": self.grammar})

    def checker(self, model: ModelInfo) -> GrammarMatcher | None:
        """A matcher the gateway feeds each choice's tokens: a worker that ignored the grammar is caught."""
        return None if self.grammar is None else model.grammars.matcher(self.grammar)


def compiles_grammar(body: Any) -> bool:
    """Whether `output_rules(model, body)` compiles a grammar (CPU work worth a thread): a JSON response_format or a
    forced tool choice. The other cases (text, tools with auto or none) are a few dict lookups."""
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type != "text":
        return True
    choice = getattr(body, "tool_choice", None)
    return choice == "required" or isinstance(choice, NamedToolChoice)


def output_rules(model: ModelInfo, body: ChatCompletionRequest | CompletionRequest) -> OutputRules | None:
    """The request's rules; ApiError (400, `param` named) for a schema or tool choice that cannot be enforced.
    Completions have response_format only."""
    response_format = body.response_format
    wants_json = response_format is not None and response_format.type != "text"
    chat = body if isinstance(body, ChatCompletionRequest) else None
    choice = (chat.tool_choice if chat is not None else None) or "auto"
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and wants_json:
        raise bad_request("response_format cannot be combined with tool_choice required or a named function",
                          param="response_format")
    if wants_json:
        assert response_format is not None
        return OutputRules(_compiled(model, _json_grammar(response_format), _SCHEMA_PARAM), None)
    return None if chat is None else _tool_rules(model, chat)


def _tool_rules(model: ModelInfo, body: ChatCompletionRequest) -> OutputRules | None:
    """auto: parse the output for calls; required / named: a grammar of calls, parsed."""
    choice = body.tool_choice or "auto"
    tools = [tool.function.model_dump(exclude_none=True) for tool in body.tools or []]
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and not tools:
        raise bad_request("tool_choice requires tools", param="tool_choice")
    if not tools or choice == "none":
        return None
    fmt = replace(tool_format(model.tokenizer), single_call=not body.parallel_tool_calls)
    if not forced:
        return OutputRules(None, fmt)
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t["name"] == choice.function.name]
        if not tools:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in tools",
                              param="tool_choice")
    try:
        lark = fmt.grammar(tools, body.parallel_tool_calls, model.tokenizer)
    except SchemaError as exc:
        raise _schema_request_error(exc, "tools") from None
    return OutputRules(_compiled(model, llguidance.LLMatcher.grammar_from_lark(lark), "tools"), fmt)


def _json_grammar(response_format: Any) -> str:
    if response_format.type == "json_object":
        return json_object_grammar()
    schema = response_format.json_schema.schema_
    try:
        return json_schema_grammar(schema if schema is not None else {"type": "object"})
    except SchemaError as exc:
        raise _schema_request_error(exc, _SCHEMA_PARAM) from None


def _compiled(model: ModelInfo, grammar: str, param: str) -> str:
    """`grammar` once llguidance compiled it against the model's tokenizer (400 naming `param` if it cannot)."""
    try:
        model.grammars.check(grammar)
    except GrammarError as exc:
        raise _schema_request_error(schema_error(str(exc)), param) from None
    return grammar


def _schema_request_error(exc: SchemaError, param: str) -> ApiError:
    return bad_request(f"{param}: {exc}", param=param)
