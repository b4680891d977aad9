"""JSON schemas as grammars: size and complexity limits, unsupported features named, JSON output options.

    check_schema(schema)                   # SchemaError (with the feature or limit) before anything compiles
    schema = prepared_schema(schema)       # checked, no finite document refused, numbers bounded (numbers.py)
    grammar = json_schema_grammar(schema)  # prepared, then llguidance grammar text; Grammars.check compiles it
    grammar = json_object_grammar()        # any JSON object (response_format json_object)
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from deepinfer.structured.finite import endless_part
from deepinfer.structured.grammar import PROBE_MESSAGES
from deepinfer.structured.numbers import bound_numbers

#: Largest schema accepted, as compact JSON.
MAX_SCHEMA_BYTES = 32 * 1024
#: Deepest nesting of objects and arrays in a schema.
MAX_SCHEMA_DEPTH = 24
#: Most objects and arrays in a schema (each keyword's value counts).
MAX_SCHEMA_NODES = 2000

#: The output's JSON layout: no free whitespace (a model cannot pad forever), the usual separators.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


class SchemaError(ValueError):
    """A schema refused before or while compiling; `feature` names the unsupported keyword when there is one."""

    def __init__(self, message: str, feature: str | None = None) -> None:
        super().__init__(message)
        self.feature = feature


def check_schema(schema: Any) -> None:
    """SchemaError unless `schema` is a JSON object within the size, depth and node limits."""
    if not isinstance(schema, dict):
        raise SchemaError(f"a JSON schema must be an object, got {type(schema).__name__}")
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise SchemaError(f"the schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are accepted")
    stack: list[tuple[Any, int]] = [(schema, 1)]
    num_nodes = 0
    while stack:  # iterative: a deep schema must not exhaust the interpreter's stack
        node, depth = stack.pop()
        num_nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if num_nodes > MAX_SCHEMA_NODES:
            raise SchemaError(f"the schema has more than {MAX_SCHEMA_NODES} objects and arrays")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def prepared_schema(schema: Any) -> dict[str, Any]:
    """`schema` as it is compiled: checked (SchemaError: limits, or no finite document), numbers bounded."""
    check_schema(schema)
    endless = endless_part(schema)
    if endless is not None:
        raise SchemaError(f"no finite JSON document satisfies the schema: {endless}")
    return bound_numbers(schema)


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON values valid under `schema` (checked first: SchemaError)."""
    schema = prepared_schema(schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise SchemaError(str(exc)) from exc


def json_object_grammar() -> str:
    """The grammar of any JSON object."""
    return json_schema_grammar({"type": "object"})


def schema_error(message: str) -> SchemaError:
    """llguidance's compile error as a SchemaError naming the unsupported feature when it says which."""
    match = _UNIMPLEMENTED.search(message)
    if match:
        keys = [key.strip().strip('"') for key in match.group(1).split(",") if key.strip()]
        feature = ", ".join(keys)
        return SchemaError(f"unsupported JSON Schema feature: {feature}", feature=keys[0] if keys else None)
    match = _UNKNOWN_FORMAT.search(message)
    if match:
        return SchemaError(f"unsupported JSON Schema format: {match.group(1)}", feature="format")
    if message.startswith(PROBE_MESSAGES):  # ours, from Grammars.check: the schema is valid, its grammar is not
        return SchemaError(message)
    return SchemaError(f"invalid JSON schema: {message}")
