"""Where the gateway's start path runs its CPU work: a short prompt is templated and tokenized on the event loop
(a thread hop costs more than the work), a long one in a worker thread (it must never block the loop); the
grammar step goes to a thread only when it compiles a grammar."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from deepinfer.testing.checkpoints import write_tokenizer_dir
from services.gateway.app import INLINE_PROMPT_BYTES
from services.gateway.openai_models import ChatCompletionRequest
from services.gateway.recipe import ModelInfo
from services.gateway.structured import compiles_grammar
from tests.gateway_harness import MODEL, Harness, make_harness


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_model_len=64 * 1024)


@pytest.fixture
async def harness(model_dir: Path) -> AsyncIterator[Harness]:
    h = await make_harness(model_dir)
    yield h
    await h.fake.stop()


async def _encoding_threads(harness: Harness, monkeypatch: pytest.MonkeyPatch, content: str) -> list[str]:
    """Names of the threads that encoded the prompt of one chat request with `content`."""
    encode, threads = ModelInfo.encode_chat_text, []

    def recording_encode(model: ModelInfo, text: str) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(model, text)

    monkeypatch.setattr(ModelInfo, "encode_chat_text", recording_encode)
    async with harness.http() as http:
        response = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert response.status_code == 200, response.text
    return threads


async def test_short_prompt_is_tokenized_on_the_loop(harness: Harness, monkeypatch: pytest.MonkeyPatch):
    assert await _encoding_threads(harness, monkeypatch, "Hi there") == [threading.current_thread().name]


async def test_long_prompt_is_tokenized_in_a_thread(harness: Harness, monkeypatch: pytest.MonkeyPatch):
    threads = await _encoding_threads(harness, monkeypatch, "word " * (INLINE_PROMPT_BYTES // 4))
    assert threads and threads != [threading.current_thread().name]


@pytest.mark.parametrize(("fields", "compiles"), [
    ({}, False),
    ({"response_format": {"type": "text"}}, False),
    ({"response_format": {"type": "json_object"}}, True),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, False),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, False),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, True),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, True),
])
def test_only_grammar_compiling_requests_leave_the_loop(fields: dict, compiles: bool):
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                 **fields})
    assert compiles_grammar(body) is compiles
