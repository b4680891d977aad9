"""Chat templates rendered the way transformers renders them (sandboxed jinja2, same globals and filters).

Templates come from model repos, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment` and see only plain JSON-like copies of the caller's data.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A message's reasoning may arrive under any of these; templates read the first (gpt-oss ones read "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat template is missing, does not compile, or failed while rendering these messages."""


class _GenerationTag(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body.
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    # `dict(...)` for templates, without exposing the real type's attributes.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Rejects underscore attributes so a template cannot reach CPython internals through a namespace.
    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick: `self` may be a keyword
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' override: no HTML escaping (jinja's own tojson escapes <, >, &, ').
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox with transformers' globals (raise_exception, strftime_now, ...)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def plain_template_data(value: Any) -> Any:
    """A copy of `value` made only of JSON types (pydantic models and dataclasses become dicts)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {plain_template_data(k): plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(item) for item in value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return plain_template_data(value.item())  # numpy scalars, e.g. np.bool_
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    aliased = []
    for message in messages:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def render_chat_template(
    template: jinja2.Template,
    messages: list[Any],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> str:
    """Render one conversation; any failure is a ChatTemplateError (a ValueError) with a clear message."""
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise ChatTemplateError("tools must be JSON schemas (dicts)")
    chat = plain_template_data(list(messages))
    if not all(isinstance(message, dict) for message in chat):
        raise ChatTemplateError("chat messages must be dicts (or pydantic models / dataclasses)")
    chat = _alias_reasoning(chat)
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message needs a final message with string content")
        chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
    try:
        rendered = template.render(
            messages=chat,
            tools=plain_template_data(tools),
            documents=plain_template_data(documents),
            add_generation_prompt=add_generation_prompt,
            **plain_template_data(template_kwargs),
        )
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc
    return rendered if final is None else _cut_at_continue_tag(rendered, final)


def _cut_at_continue_tag(rendered: str, final: str) -> str:
    # Everything the template wrote after the final message (its end-of-turn marker) is dropped.
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ChatTemplateError("continue_final_message: the template dropped part of the final message")
    tag_at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[tag_at : tag_at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:tag_at]
    return rendered[:tag_at].rstrip()
