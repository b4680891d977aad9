"""Default bounds for JSON numbers, so a grammar never lets a model write digits until max_tokens.

    schema = bound_numbers(schema)     # a copy: every integer / number gets the bounds it does not set itself

JSON Schema puts no limit on a number's digits, so `{"type": "integer"}` compiles to `-?(0|[1-9][0-9]*)`, and a
small model at temperature 0 can repeat a digit until max_tokens (issue #40: `"population": 1111...`). As
llama.cpp's and Outlines' safe JSON grammars do, every `integer` or `number` the schema leaves open gets
`minimum` / `maximum`: at most 18 digits before the point for an integer (inside int64: llguidance reads bounds
as doubles, so 2**63 - 1 itself rounds up and overflows; 10**18 - 1 compiles to the smallest range grammar), 15
for a number; and every `number` without a `multipleOf` gets `multipleOf` 1e-9: at most 9 digits after the point
and no exponent (1e-10 and finer err in llguidance's doubles). A bound the schema sets itself is kept. Cost: each
bounded field is its own range lexeme, ~0.5 ms of compile (cached per process: Grammars).
"""

from __future__ import annotations

from typing import Any

from deepinfer.structured.subschemas import map_schema

#: |value| of an integer whose schema sets no bound of its own: 18 digits.
INTEGER_BOUND = 10**18 - 1
#: |value| of a number whose schema sets no bound of its own: 15 digits before the point (exact as a double).
NUMBER_BOUND = 10**15 - 1
#: Digits after the point of a number whose schema sets no multipleOf.
FRACTION_DIGITS = 9


def bound_numbers(schema: Any) -> Any:
    """A copy of `schema` where each integer / number node has lower and upper bounds, and each number a step."""
    return map_schema(schema, _bound)


def _bound(node: dict[str, Any]) -> dict[str, Any]:
    declared = node.get("type")
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else set()
    if not types & {"integer", "number"}:
        return node
    bound = NUMBER_BOUND if "number" in types else INTEGER_BOUND
    if "minimum" not in node and "exclusiveMinimum" not in node:
        node["minimum"] = -bound
    if "maximum" not in node and "exclusiveMaximum" not in node:
        node["maximum"] = bound
    if "number" in types and "multipleOf" not in node:
        node["multipleOf"] = 10.0**-FRACTION_DIGITS
    return node
