"""Schemas before they compile: no finite document refused (naming where), numbers bounded by default, and the
gateway's probe of a new grammar; errors are one short line, never llguidance's parser state."""

from __future__ import annotations

import copy
import json

import llguidance
import pytest

from deepinfer.structured import GrammarError, Grammars, SchemaError, json_schema_grammar
from deepinfer.structured.finite import endless_part
from deepinfer.structured.grammar import public_error
from deepinfer.structured.numbers import FRACTION_DIGITS, INTEGER_BOUND, NUMBER_BOUND, bound_numbers
from deepinfer.testing.checkpoints import write_tokenizer_dir
from deepinfer.tokenizer import Tokenizer

RECURSIVE = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}


@pytest.mark.parametrize(("schema", "where"), [
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "#/$defs/a requires itself"),
    (RECURSIVE, "#/properties/next requires # again"),
    ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
      "required": ["kids"]}, "#/properties/kids/items requires # again"),
    ({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                "b": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/a"}}}, "$ref": "#/$defs/a"},
     "#/$defs/b/items requires #/$defs/a again"),
    ({"type": "object", "properties": {"x": False}, "required": ["x"]}, "# requires a part that allows nothing"),
])
def test_a_schema_no_finite_document_satisfies_is_named(schema: dict, where: str):
    assert endless_part(schema).startswith(where)
    with pytest.raises(SchemaError, match="no finite JSON document satisfies the schema"):
        json_schema_grammar(schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}}, "required": ["v"]},
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    {"anyOf": [{"type": "null"}, RECURSIVE]},
    {"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # a string is a valid instance
    {"$ref": "https://example.com/remote.json"},  # not ours to resolve: the compiler reports it
])
def test_recursion_with_a_way_out_is_fine(schema: dict):
    assert endless_part(schema) is None


def test_numbers_get_bounds_they_do_not_set_on_a_copy():
    schema = {
        "type": "object",
        "properties": {
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "age": {"type": "integer", "minimum": 0},
            "price": {"type": "number", "exclusiveMaximum": 10, "multipleOf": 0.01},
            "tags": {"type": "array", "items": {"type": ["integer", "null"]}},
        },
        "$defs": {"n": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
    }
    original = copy.deepcopy(schema)
    bounded = bound_numbers(schema)
    assert schema == original
    properties = bounded["properties"]
    assert properties["count"] == {"type": "integer", "minimum": -INTEGER_BOUND, "maximum": INTEGER_BOUND}
    assert properties["ratio"] == {"type": "number", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND,
                                   "multipleOf": 10.0**-FRACTION_DIGITS}
    assert properties["age"] == {"type": "integer", "minimum": 0, "maximum": INTEGER_BOUND}
    assert properties["price"] == {"type": "number", "exclusiveMaximum": 10, "multipleOf": 0.01,
                                   "minimum": -NUMBER_BOUND}
    assert properties["tags"]["items"]["maximum"] == INTEGER_BOUND
    assert bounded["$defs"]["n"]["anyOf"] == [
        {"type": "integer", "minimum": -INTEGER_BOUND, "maximum": INTEGER_BOUND}, {"type": "string"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    return Grammars(tokenizer)


def _accepts(grammars: Grammars, tokenizer: Tokenizer, schema: dict, text: str) -> bool:
    matcher = grammars.matcher(json_schema_grammar(schema))
    return matcher.accept_all(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting


@pytest.mark.parametrize(("schema", "text", "ok"), [
    ({"type": "integer"}, "9" * 18, True),
    ({"type": "integer"}, "-" + "9" * 18, True),
    ({"type": "integer"}, "1" * 19, False),
    ({"type": "integer", "minimum": 5}, "4", False),  # the schema's own bound is kept
    ({"type": "integer", "minimum": 5}, "9" * 18, True),
    ({"type": "number"}, "3.141592653", True),
    ({"type": "number"}, "3.1415926535", False),  # a 10th digit after the point
    ({"type": "number"}, "1e5", False),
    ({"type": "number"}, "9" * 14 + ".5", True),
    ({"type": "number"}, "9" * 16, False),
])
def test_bounded_numbers_end(grammars: Grammars, tokenizer: Tokenizer, schema: dict, text: str, ok: bool):
    assert _accepts(grammars, tokenizer, schema, text) is ok


@pytest.mark.parametrize("pattern", ["^a{100000}$", "^(x{1000}){1000}$"])
def test_a_grammar_past_the_limits_is_refused_before_it_runs(grammars: Grammars, pattern: str):
    grammar = json_schema_grammar({"type": "string", "pattern": pattern})
    with pytest.raises(GrammarError) as refused:
        grammars.check(grammar)
    message = str(refused.value)
    assert message.startswith("the grammar exceeds this server's limits")
    assert "<state>" not in message and "\n" not in message and len(message) <= 200


def test_a_grammar_nothing_satisfies_is_refused(grammars: Grammars):
    # llguidance compiles a $ref loop (prepared_schema refuses it before: this is the probe's own check)
    loop = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    with pytest.raises(GrammarError, match="^no output satisfies the grammar$"):
        grammars.check(llguidance.LLMatcher.grammar_from_json_schema(loop))


def test_errors_drop_the_parser_state():
    dump = 'lexer error: too many expressions constructed\n<state>\nTokens: ⟦"⟧\n{"compute_time_us": 21}'
    assert public_error(dump) == "lexer error: too many expressions constructed"
    assert public_error("x" * 500).endswith("...") and len(public_error("x" * 500)) == 200


def test_matchers_are_independent_copies_of_one_compile(grammars: Grammars, tokenizer: Tokenizer):
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    first, second = grammars.matcher(grammar), grammars.matcher(grammar)
    assert first.accept_all(tokenizer.encode('{"a": true}', add_special_tokens=False)) and first.is_accepting
    assert not second.is_accepting  # still at the start
    assert list(grammars._compiled).count(grammar) == 1
    assert json.loads(grammar)  # the grammar text is what travels; the compile stays in this process
