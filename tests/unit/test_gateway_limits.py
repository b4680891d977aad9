"""Per-key rate limits: 429 with Retry-After and OpenAI's x-ratelimit-* headers (the official SDK sees a
RateLimitError); buckets refill with time and are kept per key; x-request-id comes back on every response."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from deepinfer.testing.checkpoints import write_tokenizer_dir
from services.gateway.limits import format_reset
from tests.gateway_harness import GATEWAY_ID, MODEL, Harness, make_harness

MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


async def _limited(model_dir: Path, **settings: int) -> tuple[Harness, Clock]:
    h = await make_harness(model_dir, settings={"api_keys": ["sk-a", "sk-b"], **settings})
    clock = Clock()
    h.state.limits.clock = clock
    return h, clock


async def test_requests_per_minute_is_a_429_the_sdk_raises_as_rate_limit_error(model_dir: Path):
    h, clock = await _limited(model_dir, requests_per_minute=2)
    client = h.openai("sk-a")
    first = await client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"] == "30s"
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    response = refused.value.response
    assert response.status_code == 429
    assert response.headers["retry-after"] == "30"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert len(h.fake.route_requests) == 2  # the refused one never reached a worker
    # another key has its own allowance; the first key's refills with time
    await h.openai("sk-b").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    clock.now_s += 30.0
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    await h.fake.stop()


async def test_tokens_per_minute_counts_prompt_and_max_tokens(model_dir: Path):
    h, clock = await _limited(model_dir, tokens_per_minute=60)
    client = h.openai("sk-a")
    prompt_tokens = len(h.tokenizer.encode_chat(MESSAGES))
    ok = await client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=20)
    left = 60 - prompt_tokens - 20
    assert ok.headers["x-ratelimit-remaining-tokens"] == str(left)
    assert "x-ratelimit-limit-requests" not in ok.headers  # that limit is off
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30)
    assert refused.value.response.json()["error"]["type"] == "tokens"
    wait_s = int(refused.value.response.headers["retry-after"])
    assert wait_s == prompt_tokens + 30 - left  # a token a second refills
    clock.now_s += wait_s
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30)
    # more than a whole minute's tokens can never pass: no Retry-After to wait for
    clock.now_s += 60
    with pytest.raises(openai.RateLimitError) as too_large:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60 - prompt_tokens + 1)
    assert "retry-after" not in too_large.value.response.headers
    assert "Request too large" in too_large.value.response.json()["error"]["message"]
    await h.fake.stop()


async def test_x_request_id_in_and_out(model_dir: Path):
    h = await make_harness(model_dir, settings={"api_keys": ["sk-a"]})
    async with h.http() as http:
        auth = {"Authorization": "Bearer sk-a"}
        chat = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, headers=auth)
        assert chat.headers["x-request-id"] == chat.json()["id"]
        echoed = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": True},
                                 headers={**auth, "x-request-id": "client-123"})
        assert echoed.headers["x-request-id"] == "client-123"
        refused = await http.get("/v1/models", headers={"x-request-id": "client-456"})
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "client-456"
        # which of the gateway processes sharing the port answered, on every response
        assert chat.headers["x-deepinfer-gateway"] == refused.headers["x-deepinfer-gateway"] == GATEWAY_ID
        fresh = await http.get("/health")
        assert len(fresh.headers["x-request-id"]) == 32
        hostile = await http.get("/v1/models", headers={**auth, "x-request-id": "x" * 300})
        assert hostile.headers["x-request-id"] != "x" * 300
    await h.fake.stop()


def test_reset_durations_read_as_openais():
    assert [format_reset(s) for s in (0.0174, 6.0, 90.0, 59.2)] == ["18ms", "6s", "1m30s", "1m0s"]
