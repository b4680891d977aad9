"""Where a JSON schema holds other schemas (2020-12 and draft-07 keywords), to walk or rebuild a schema tree.

    for key, child in subschemas(node): ...          # ("properties/name", {...}), ("items", {...}), ...
    copy = map_schema(schema, fn)                    # fn(node) on every object node, bottom-up, on a copy
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

#: Keywords whose value is one schema.
SCHEMA_KEYWORDS = (
    "additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
    "unevaluatedItems", "unevaluatedProperties", "additionalItems",
)
#: Keywords whose value is a list of schemas.
LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
#: Keywords whose value maps names to schemas.
MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def subschemas(node: Any) -> Iterator[tuple[str, Any]]:
    """(JSON pointer segment from `node`, child schema) for every schema directly inside `node`."""
    if not isinstance(node, dict):
        return
    for key in SCHEMA_KEYWORDS:
        child = node.get(key)
        if isinstance(child, dict | bool):
            yield key, child
    for key in LIST_KEYWORDS:
        children = node.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield f"{key}/{i}", child
    for key in MAP_KEYWORDS:
        children = node.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                yield f"{key}/{_escape(name)}", child


def map_schema(schema: Any, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of `schema` with `fn` applied to every object node (children first); `schema` is left as it is."""
    if not isinstance(schema, dict):
        return schema
    node = dict(schema)
    for key in SCHEMA_KEYWORDS:
        if isinstance(node.get(key), dict):
            node[key] = map_schema(node[key], fn)
    for key in LIST_KEYWORDS:
        if isinstance(node.get(key), list):
            node[key] = [map_schema(child, fn) for child in node[key]]
    for key in MAP_KEYWORDS:
        if isinstance(node.get(key), dict):
            node[key] = {name: map_schema(child, fn) for name, child in node[key].items()}
    return fn(node)


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
