"""The engine under a grammar (tiny random model, CPU): every output is valid and ends with "stop" when the grammar
is complete, async scheduling gives the synchronous tokens, and the prefill → decode handoff continues the grammar
from the first token."""

from __future__ import annotations

import json

import pytest

from deepinfer.engine import Engine, EngineArgs, EngineRequest, PulledKv
from deepinfer.protocol import FinishReason
from deepinfer.sampling.params import SamplingParams
from deepinfer.structured import json_schema_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["calm", "busy", "odd"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["mood", "n", "tags"],
    "additionalProperties": False,
}
PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77]


def engine(tiny_dir, async_scheduling: bool) -> Engine:
    return Engine(EngineArgs(model=str(tiny_dir), block_size=4, progress=False, async_scheduling=async_scheduling))


def run(core: Engine) -> dict[str, tuple[list[int], FinishReason | None]]:
    results: dict[str, tuple[list[int], FinishReason | None]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens, _ = results.get(out.request_id, ([], None))
            results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    return results


def check_output(core: Engine, token_ids: list[int], finish: FinishReason | None) -> dict:
    assert finish is FinishReason.STOP
    assert core.tokenizer is not None
    value = json.loads(core.tokenizer.decode(token_ids))
    assert set(value) == {"mood", "n", "tags"} and value["mood"] in ("calm", "busy", "odd")
    assert 0 <= value["n"] <= 99 and len(value["tags"]) <= 2
    return value


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=80),
    SamplingParams(temperature=1.0, seed=7, max_tokens=80),
]


@pytest.mark.parametrize("params", PARAMS)
def test_async_scheduling_gives_the_synchronous_valid_output(tiny_dir, params: SamplingParams):
    params = params.clone(grammar=json_schema_grammar(SCHEMA))
    results = []
    for mode in (False, True):
        core = engine(tiny_dir, mode)
        core.add_request(EngineRequest("r", PROMPT, params))
        free = SamplingParams(temperature=0.0, max_tokens=6)
        core.add_request(EngineRequest("free", PROMPT[:5], free))  # a free row beside
        results.append(run(core))
        check_output(core, *results[-1]["r"])
    assert results[0] == results[1]


def test_prefill_then_decode_continues_the_grammar(tiny_dir):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=80, grammar=json_schema_grammar(SCHEMA))
    reference = engine(tiny_dir, False)
    reference.add_request(EngineRequest("r", PROMPT, params))
    expected, _ = run(reference)["r"]
    prefill = engine(tiny_dir, True)
    prefill.add_request(EngineRequest("r", PROMPT, params.clone(max_tokens=1), hold_blocks=True))
    first, _ = run(prefill)["r"]
    assert first == expected[:1]
    payloads = prefill.export_held("r", prefill.held_block_ids("r"))
    decode = engine(tiny_dir, True)
    admission = decode.add_request(EngineRequest("r", PROMPT, params, output_token_ids=first, kv=PulledKv(payloads)))
    assert admission.kv == "pulled"
    rest, finish = run(decode)["r"]
    assert first + rest == expected
    check_output(decode, first + rest, finish)
    assert prefill.release_held("r")


def test_a_first_token_the_grammar_forbids_is_refused(tiny_dir):
    core = engine(tiny_dir, False)
    assert core.tokenizer is not None
    not_json = core.tokenizer.encode("x", add_special_tokens=False)
    params = SamplingParams(max_tokens=8, grammar=json_schema_grammar(SCHEMA))
    with pytest.raises(ValueError, match="grammar"):
        core.add_request(EngineRequest("r", PROMPT, params, output_token_ids=not_json))
    with pytest.raises(ValueError):
        looping = params.clone(grammar='{"grammars": [{"json_schema": {"$ref": "#/x"}}]}')
        core.add_request(EngineRequest("r", PROMPT, looping))
