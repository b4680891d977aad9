"""The official SDKs' sync clients against the gateway on a real port (harness gateway, FakeWorkers): OpenAI chat
and Anthropic messages, whole and streamed, and /tokenize, all with the one API key."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.fuzz.gateway import API_KEY, fuzz_model_dir, served_gateway
from tests.gateway_harness import ANSWER, MODEL

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served_gateway(fuzz_model_dir(tmp_path_factory.mktemp("tok"))) as (url, _):
        yield url


def test_openai_sync_client(base_url: str):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40)
    assert whole.choices[0].message.content == ANSWER
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ANSWER
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-no", max_retries=0).models.list()


def test_anthropic_sync_client(base_url: str):
    client = anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=30)
    whole = client.messages.create(model=MODEL, max_tokens=40, messages=MESSAGES)
    assert whole.content[0].text == ANSWER and whole.stop_reason == "end_turn"
    with client.messages.stream(model=MODEL, max_tokens=40, messages=MESSAGES) as stream:
        assert "".join(stream.text_stream) == ANSWER
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base_url, api_key="sk-no", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=MESSAGES)


def test_tokenize_round_trip_over_http(base_url: str):
    headers = {"Authorization": f"Bearer {API_KEY}", "x-request-id": "sync-1"}
    tokens = httpx.post(f"{base_url}/tokenize", json={"prompt": "Hello there"}, headers=headers, timeout=30)
    assert tokens.headers["x-request-id"] == "sync-1"
    text = httpx.post(f"{base_url}/detokenize", json={"tokens": tokens.json()["tokens"]}, headers=headers, timeout=30)
    assert text.json()["prompt"].endswith("Hello there")
