"""Request fields beyond what a route reads: vLLM's extensions this server does not implement are a 400 naming the
field (unless at their no-op value), OpenAI's bookkeeping fields are accepted quietly, anything else unknown is
ignored with a warning in the log (as vLLM does)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from deepinfer.testing.checkpoints import write_tokenizer_dir
from tests.gateway_harness import MODEL, make_harness

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


async def post(model_dir: Path, route: str, body: dict):
    h = await make_harness(model_dir)
    async with h.http() as http:
        response = await http.post(route, json=body)
    await h.fake.stop()
    return response


@pytest.mark.parametrize(("route", "body", "field"), [
    ("/v1/completions", COMPLETION, "use_beam_search"),
    ("/v1/completions", COMPLETION, "guided_json"),
    ("/v1/completions", COMPLETION, "allowed_token_ids"),
    ("/v1/completions", COMPLETION, "truncate_prompt_tokens"),
    ("/v1/chat/completions", CHAT, "bad_words"),
    ("/v1/chat/completions", CHAT, "echo"),
    ("/v1/chat/completions", CHAT, "return_tokens_as_token_ids"),
])
async def test_an_unimplemented_vllm_extension_is_a_400_naming_it(model_dir: Path, route, body, field):
    value = {"use_beam_search": True, "guided_json": {"type": "object"}, "allowed_token_ids": [5],
             "truncate_prompt_tokens": 8, "bad_words": ["x"], "echo": True,
             "return_tokens_as_token_ids": True}[field]
    response = await post(model_dir, route, {**body, field: value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field and "vLLM" in response.json()["error"]["message"]


async def test_their_no_op_values_are_accepted(model_dir: Path, caplog):
    no_ops = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "priority": 0,
              "spaces_between_special_tokens": True, "add_special_tokens": True, "return_token_ids": False}
    with caplog.at_level(logging.WARNING, logger="services.gateway.presenters"):
        response = await post(model_dir, "/v1/completions", {**COMPLETION, **no_ops})
    assert response.status_code == 200, response.text
    assert "ignored" not in caplog.text


async def test_openai_bookkeeping_is_quiet_and_the_unknown_is_logged(model_dir: Path, caplog):
    with caplog.at_level(logging.WARNING, logger="services.gateway.presenters"):
        quiet = await post(model_dir, "/v1/chat/completions", {**CHAT, "store": False, "metadata": {"a": "b"},
                                                                "service_tier": "auto", "prompt_cache_key": "k"})
        assert quiet.status_code == 200 and "ignored" not in caplog.text
        logged = await post(model_dir, "/v1/chat/completions", {**CHAT, "frobnicate": 3})
    assert logged.status_code == 200
    assert "fields ignored (unknown to this server): ['frobnicate']" in caplog.text
