"""Structured output on a tiny tokenizer: the grammar matcher's mask, the sampler applying it, the engine request
that stops when its grammar is complete, and the schema limits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer.engine.request import Request, check_stop
from deepinfer.protocol import FinishReason, WireSamplingParams
from deepinfer.sampling.metadata import SamplingMetadata
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.sampler import Sampler
from deepinfer.structured import (
    GrammarError,
    Grammars,
    SchemaError,
    check_schema,
    json_object_grammar,
    json_schema_grammar,
)
from deepinfer.structured.schema import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, schema_error
from deepinfer.testing.checkpoints import EOS_TOKEN_ID, write_tokenizer_dir
from deepinfer.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    return Grammars(tokenizer)


def _allowed(bitmask: bytes, vocab_size: int) -> set[int]:
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32)
    return {t for t in range(vocab_size) if (int(words[t // 32]) >> (t % 32)) & 1}


def _decode_each(tokenizer: Tokenizer, token_ids: set[int]) -> set[str]:
    return {tokenizer.decode([t], skip_special_tokens=False) for t in token_ids}


def test_mask_allows_only_what_the_schema_allows_next(tokenizer: Tokenizer, grammars: Grammars):
    matcher = grammars.matcher(json_schema_grammar(SCHEMA))
    first = _allowed(matcher.bitmask(), grammars.vocab_size)
    assert first and all(text and '{"ok": '.startswith(text) for text in _decode_each(tokenizer, first))
    assert matcher.accept_all(tokenizer.encode('{"ok": ', add_special_tokens=False))
    after_key = _decode_each(tokenizer, _allowed(matcher.bitmask(), grammars.vocab_size))
    assert after_key and all("true".startswith(t) or "false".startswith(t) for t in after_key)
    assert not matcher.is_accepting and not matcher.is_stopped


def test_matcher_stops_when_the_value_is_complete_and_refuses_what_breaks_it(
    tokenizer: Tokenizer, grammars: Grammars
):
    matcher = grammars.matcher(json_schema_grammar(SCHEMA))
    assert matcher.accept_all(tokenizer.encode('{"ok": true, "n": 7}', add_special_tokens=False))
    assert matcher.is_accepting and matcher.is_stopped
    broken = grammars.matcher(json_schema_grammar(SCHEMA))
    assert not broken.accept_all(tokenizer.encode('{"n": 7}', add_special_tokens=False))  # ok must come first
    assert broken.error and broken.is_stopped


def test_json_object_accepts_any_object_and_then_eos(tokenizer: Tokenizer, grammars: Grammars):
    matcher = grammars.matcher(json_object_grammar())
    assert matcher.accept_all(tokenizer.encode('{"a": [1, "x"]}', add_special_tokens=False))
    assert matcher.is_accepting
    assert matcher.accept(EOS_TOKEN_ID) and matcher.is_stopped and matcher.is_accepting


def test_sampler_takes_the_best_allowed_token_not_the_best_token(grammars: Grammars):
    vocab_size = grammars.vocab_size + 7  # the model's vocabulary may be wider than the tokenizer's
    masks = [grammars.matcher(json_schema_grammar(SCHEMA)).bitmask(), None]
    logits = torch.zeros(2, vocab_size)
    logits[:, vocab_size - 1] = 50.0  # past the tokenizer: never allowed under a grammar
    logits[:, 65] = 40.0  # "b": not JSON
    allowed = _allowed(masks[0], grammars.vocab_size)
    favourite = max(allowed)
    logits[0, favourite] = 1.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    meta = SamplingMetadata.build(params, [0, 0], [1, 2], [[1], [1]], [[], []], vocab_size, "cpu",
                                  grammar_bitmasks=masks)
    assert meta.allowed is not None and meta.allowed.shape == (2, vocab_size)
    assert meta.allowed[1].all() and not meta.allowed[0, vocab_size - 1]
    out = Sampler()(logits, meta)
    assert out.token_ids.tolist() == [favourite, vocab_size - 1]  # the free row is untouched
    random = [SamplingParams(temperature=1.0, seed=3)] * 2
    meta = SamplingMetadata.build(random, [0, 1], [3, 4], [[1], [1]], [[], []], vocab_size, "cpu",
                                  grammar_bitmasks=[masks[0], masks[0]])
    assert set(Sampler()(logits, meta).token_ids.tolist()) <= allowed


def test_no_grammar_builds_no_mask():
    meta = SamplingMetadata.build([SamplingParams()], [0], [1], [[1]], [[]], 50, "cpu")
    assert meta.allowed is None


def test_request_with_a_grammar_finishes_with_stop_when_complete(tokenizer: Tokenizer, grammars: Grammars):
    params = SamplingParams(max_tokens=50, grammar=json_schema_grammar(SCHEMA))
    request = Request("r", [1, 2], params, eos_token_ids=[EOS_TOKEN_ID])
    request.grammar = grammars.matcher(params.grammar)
    token_ids = tokenizer.encode('{"ok": false, "n": 0}', add_special_tokens=False)
    for token_id in token_ids[:-1]:
        request.append_output_token_id(token_id)
        assert not check_stop(request, 1000)
    request.append_output_token_id(token_ids[-1])
    assert check_stop(request, 1000)
    assert request.finish_reason is FinishReason.STOP


def test_grammar_travels_on_the_wire():
    grammar = json_schema_grammar(SCHEMA)
    wire = WireSamplingParams(grammar=grammar)
    decoded = WireSamplingParams.from_bytes(wire.to_bytes())
    assert decoded.grammar == grammar
    assert SamplingParams(**decoded.model_dump(exclude={"v"})).grammar == grammar
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar="")


def test_schema_limits_refuse_big_and_deep_schemas():
    deep: dict = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(SchemaError, match="deeper"):
        check_schema(deep)
    big = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
    with pytest.raises(SchemaError, match="bytes"):
        check_schema(big)
    with pytest.raises(SchemaError, match="object"):
        check_schema([{"type": "object"}])
    check_schema(SCHEMA)


@pytest.mark.parametrize(("schema", "feature"), [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "string", "format": "no-such-format"}, "format"),
])
def test_unsupported_features_are_named(grammars: Grammars, schema: dict, feature: str):
    with pytest.raises(GrammarError) as caught:
        grammars.check(json_schema_grammar(schema))
    error = schema_error(str(caught.value))
    assert error.feature == feature and feature in str(error)


def test_a_grammar_that_does_not_compile_is_a_value_error(grammars: Grammars, tmp_path: Path):
    with pytest.raises(ValueError):
        grammars.matcher(json.dumps({"grammars": [{"json_schema": {"$ref": "#/missing"}}]}))
