"""Hostile input never costs more than a 400: each malformed request of issue #14 gets a 4xx in OpenAI's shape,
before routing, within bounded time and memory, and the gateway still serves afterwards."""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from deepinfer.testing import FakeBroker, FakeBus
from deepinfer.testing.checkpoints import write_tokenizer_dir
from deepinfer.tokenizer.tokenizer import MAX_COMPILED_TEMPLATES
from tests.gateway_harness import ANSWER, MODEL, Harness, make_harness

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}
PROMPT = {"model": MODEL, "prompt": "Hi there"}
BOMB = "{{ 'a' * 200000000 }}"
#: What one refused request may take: a hostile body is refused well before it costs real time or memory. Counted
#: in this process's CPU time (the gateway runs in it), which other jobs on a busy machine do not inflate.
MAX_SECONDS = 2.0
MAX_PEAK_BYTES = 64 * 2**20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture
async def harness(model_dir: Path) -> AsyncIterator[Harness]:
    h = await make_harness(model_dir)
    yield h
    await h.fake.stop()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _raw(body: dict[str, Any], **raw_fields: str) -> bytes:
    """`body` as JSON with `raw_fields` spliced in as literal JSON text (what json.dumps cannot write)."""
    text = json.dumps(body)[:-1]
    for key, value in raw_fields.items():
        text += f', "{key}": {value}'
    return (text + "}").encode()


# (route, body: a dict or raw bytes, status, param)
HOSTILE: dict[str, tuple[str, Any, int, str | None]] = {
    "template in kwargs": ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"chat_template": BOMB}}, 400,
                           "chat_template_kwargs.chat_template"),
    "template field": ("/v1/chat/completions", {**CHAT, "chat_template": BOMB}, 400, "chat_template"),
    "1000-level nesting": ("/v1/chat/completions", _raw(CHAT, extra=_nested(1000)), 400, None),
    "100000-level nesting": ("/v1/chat/completions", _raw(CHAT, extra=_nested(100_000)), 400, None),
    "lone surrogate": ("/v1/completions", _raw({"model": MODEL}, prompt='"a\\ud800b"'), 400, None),
    "non-utf8 body": ("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    "NaN": ("/v1/chat/completions", _raw(CHAT, temperature="NaN"), 400, None),
    "1e999": ("/v1/chat/completions", _raw(CHAT, repetition_penalty="1e999"), 400, "repetition_penalty"),
    "seed 2**70": ("/v1/chat/completions", {**CHAT, "seed": 2**70}, 400, "seed"),
    "seed -2**70": ("/v1/completions", {**PROMPT, "seed": -(2**70)}, 400, "seed"),
    "top_k 2**70": ("/v1/chat/completions", {**CHAT, "top_k": 2**70}, 400, "top_k"),
    "stop_token_ids 2**70": ("/v1/chat/completions", {**CHAT, "stop_token_ids": [2**70]}, 400, "stop_token_ids"),
    "logit_bias key 2**70": ("/v1/chat/completions", {**CHAT, "logit_bias": {str(2**70): 1}}, 400, "logit_bias"),
    "logit_bias key 5000 digits": ("/v1/chat/completions", {**CHAT, "logit_bias": {"9" * 5000: 1}}, 400,
                                   "logit_bias"),
    "2 MB cache_salt": ("/v1/chat/completions", {**CHAT, "cache_salt": "s" * 2_000_000}, 400, "cache_salt"),
    "1.2 MB stop string": ("/v1/chat/completions", {**CHAT, "stop": "x" * 1_200_000}, 400, "stop"),
    "1.2 MB of stop strings": ("/v1/chat/completions", {**CHAT, "stop": ["x" * 1000] * 1200}, 400, "stop"),
    'repetition_penalty "inf"': ("/v1/chat/completions", {**CHAT, "repetition_penalty": "inf"}, 400,
                                 "repetition_penalty"),
    "min_tokens > max_tokens": ("/v1/completions", {**PROMPT, "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens"),
    'stop [""]': ("/v1/chat/completions", {**CHAT, "stop": [""]}, 400, "stop"),
    'stop ""': ("/v1/completions", {**PROMPT, "stop": ""}, 400, "stop"),
    "negative stop_token_ids": ("/v1/chat/completions", {**CHAT, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    "out-of-vocabulary stop_token_ids": ("/v1/completions", {**PROMPT, "stop_token_ids": [384]}, 400,
                                         "stop_token_ids"),
    "out-of-vocabulary logit_bias": ("/v1/chat/completions", {**CHAT, "logit_bias": {"384": 5}}, 400, "logit_bias"),
    'stream "yes"': ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream"),
    "max_tokens true": ("/v1/completions", {**PROMPT, "max_tokens": True}, 400, "max_tokens"),
    "n true": ("/v1/chat/completions", {**CHAT, "n": True}, 400, "n"),
    'temperature "0.5"': ("/v1/chat/completions", {**CHAT, "temperature": "0.5"}, 400, "temperature"),
    "image content part": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        400, "messages.0.content"),
    "audio output": ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    "audio modality": ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, 400, "modalities"),
    "legacy functions": ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    "prompt token ids as strings": ("/v1/completions", {"model": MODEL, "prompt": ["1", 2]}, 400, "prompt"),
    # each message or part is a model pydantic builds with the loop held: counted on the raw JSON first
    "25k messages": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a"}] * 25_000},
                      400, "messages"),
    "25k content parts": ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * 25_000}]}, 400, "messages"),
    "25k messages to /tokenize": ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "a"}]
                                                 * 25_000}, 400, "messages"),
    "25k Anthropic blocks": ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * 25_000}]}, 400, None),
}


async def _post(harness: Harness, path: str, body: Any) -> tuple[Any, float, int]:
    """The response, the CPU seconds this process (client and gateway) spent on it, and the peak bytes Python
    allocated meanwhile."""
    tracemalloc.start()
    start = time.process_time()
    try:
        async with harness.http() as http:
            if isinstance(body, bytes):
                response = await http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                response = await http.post(path, json=body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return response, time.process_time() - start, peak


def _error(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_hostile_input_is_a_cheap_4xx_and_the_gateway_still_serves(harness: Harness, case: str):
    path, body, status, param = HOSTILE[case]
    response, seconds, peak = await _post(harness, path, body)
    assert response.status_code == status, response.text[:300]
    if path == "/v1/messages":  # Anthropic's error shape
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert seconds < MAX_SECONDS
        return
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(f"{param}."), error  # stop.0: the first entry
    assert "di." not in error["message"] and len(error["message"]) < 1000
    assert seconds < MAX_SECONDS and peak < MAX_PEAK_BYTES, (seconds, peak)
    assert harness.fake.route_requests == []  # refused before routing
    result = await harness.openai().chat.completions.create(model=MODEL, messages=CHAT["messages"])
    assert result.choices[0].message.content == ANSWER


async def test_request_templates_render_only_when_trusted_and_the_cache_is_bounded(model_dir: Path):
    h = await make_harness(model_dir, settings={"trust_request_chat_template": True})
    tokenizer = h.tokenizer
    async with h.http() as http:
        for i in range(3 * MAX_COMPILED_TEMPLATES):
            template = f"{{% for m in messages %}}{i}:{{{{ m.content }}}}{{% endfor %}}"
            response = await http.post("/v1/chat/completions", json={**CHAT, "chat_template": template})
            assert response.status_code == 200, response.text
            assert h.fake.prefill_requests[-1].prompt_token_ids == tokenizer.encode(f"{i}:Hi there",
                                                                                     add_special_tokens=False)
    assert len(tokenizer._compiled_templates) <= MAX_COMPILED_TEMPLATES
    await h.fake.stop()


async def test_a_models_own_named_template_needs_no_trust(harness: Harness):
    async with harness.http() as http:
        named = await http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"chat_template":
                                                                                               "default"}})
    assert named.status_code == 200, named.text


async def test_a_request_too_large_for_the_bus_is_413_naming_no_subject(model_dir: Path):
    broker = FakeBroker(max_payload=4096)
    h = await make_harness(model_dir, gateway_bus=FakeBus(broker, "gateway"), worker_bus=FakeBus(broker, "workers"))
    response, _, _ = await _post(h, "/v1/chat/completions", {**CHAT, "stop": ["y" * 1000] * 8})
    assert response.status_code == 413, response.text
    error = _error(response)
    assert error["code"] == "request_too_large" and "di." not in error["message"]
    ok = await h.openai().chat.completions.create(model=MODEL, messages=CHAT["messages"])
    assert ok.choices[0].message.content == ANSWER
    await h.fake.stop()


# A prompt longer than max_prompt_chars: a 400 on every route that tokenizes text, before any tokenizing.
OVERSIZED = {
    "/v1/completions": ({**PROMPT, "prompt": "x" * 1001}, "prompt"),
    "/v1/chat/completions": ({**CHAT, "messages": [{"role": "user", "content": "x" * 1001}]}, "messages"),
    "/tokenize": ({"model": MODEL, "prompt": "x" * 1001}, "prompt"),
    "/v1/messages": ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 1001}]},
                     None),
}


@pytest.mark.parametrize("path", list(OVERSIZED))
async def test_a_prompt_over_max_prompt_chars_is_refused_before_it_is_tokenized(
    model_dir: Path, path: str, monkeypatch: pytest.MonkeyPatch
):
    h = await make_harness(model_dir, settings={"max_prompt_chars": 1000})
    backend = type(h.tokenizer.backend)
    encoded: list[int] = []
    for name in ("encode", "encode_batch"):
        original = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda self, text, *a, _f=original, **k: encoded.append(len(text))
                            or _f(self, text, *a, **k))
    body, param = OVERSIZED[path]
    response, seconds, _ = await _post(h, path, body)
    assert response.status_code == 400, response.text
    if path == "/v1/messages":  # Anthropic's error shape
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert "max_prompt_chars" in response.json()["error"]["message"]
    else:
        error = _error(response)
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error", "context_length_exceeded", param)
        assert "1000 characters (max_prompt_chars)" in error["message"], error
    assert not any(n > 1000 for n in encoded), encoded  # the long text never reached the tokenizer
    assert h.fake.route_requests == []
    await h.fake.stop()


def test_max_prompt_chars_defaults_to_what_the_context_can_hold(model_dir: Path):
    from services.gateway.recipe import ModelInfo

    model = ModelInfo.from_dir(model_dir, MODEL)
    tokenizer = model.tokenizer
    longest = max(len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size))
    assert tokenizer.max_token_chars == longest
    assert model.max_prompt_chars == model.max_model_len * longest
    assert ModelInfo.from_dir(model_dir, MODEL, max_prompt_chars=123).max_prompt_chars == 123
