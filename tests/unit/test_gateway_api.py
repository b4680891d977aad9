"""Gateway API over a FakeBus with scripted workers: responses, SSE framing (parsed by the openai client), errors."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from deepinfer.hashing import hash_blocks
from deepinfer.protocol import ErrorCode, WorkerRole
from deepinfer.testing.checkpoints import write_tokenizer_dir
from deepinfer.testing.fake_workers import worker_load
from tests.gateway_harness import ANSWER, MAX_MODEL_LEN, MODEL, Harness, make_harness


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture
async def harness(model_dir: Path) -> AsyncIterator[Harness]:
    h = await make_harness(model_dir, num_cached_tokens=16)
    yield h
    await h.fake.stop()


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}


async def test_chat_non_stream(harness: Harness):
    client = harness.openai()
    result = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}])
    assert result.object == "chat.completion"
    assert result.choices[0].message.content == ANSWER
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].finish_reason == "stop"
    prompt_ids = harness.tokenizer.encode_chat([{"role": "user", "content": "Hi there"}])
    num_answer = len(harness.fake.output_token_ids)
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == num_answer
    assert result.usage.total_tokens == len(prompt_ids) + num_answer
    assert result.usage.prompt_tokens_details.cached_tokens == 16
    # prefill computed the first token; decode got it as output_token_ids with the prompt
    (decode,) = harness.fake.decode_requests
    assert decode.prompt_token_ids == prompt_ids
    assert decode.output_token_ids == [harness.fake.output_token_ids[0]]
    assert decode.prefill_worker_id == "prefill-0"
    assert decode.sampling.max_tokens == MAX_MODEL_LEN - len(prompt_ids)
    assert harness.fake.cancels == []  # finished normally: nothing to cancel


async def test_chat_stream_framing(harness: Harness):
    client = harness.openai()
    stream = await client.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ANSWER
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == len(harness.fake.output_token_ids)
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


async def test_raw_sse_ends_with_done(harness: Harness):
    async with harness.http() as http:
        response = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in response.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][len("data: ") :])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in first  # only with stream_options.include_usage


async def test_completions_stream_and_non_stream(harness: Harness):
    client = harness.openai()
    result = await client.completions.create(model=MODEL, prompt="The quick", max_tokens=5)
    expected = harness.tokenizer.decode(harness.fake.output_token_ids[:5])
    assert result.object == "text_completion"
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(harness.tokenizer.encode("The quick"))
    assert result.usage.prompt_tokens_details.cached_tokens == 16
    stream = await client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    assert harness.fake.decode_requests[-1].prompt_token_ids == [5, 6, 7]


async def test_chat_logprobs_shape(harness: Harness):
    client = harness.openai()
    result = await client.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], logprobs=True, top_logprobs=2, max_tokens=3
    )
    content = result.choices[0].logprobs.content
    ids = harness.fake.output_token_ids[:3]
    assert [c.token for c in content] == [harness.tokenizer.decode([i]) for i in ids]
    assert all(c.logprob == -0.5 and len(c.top_logprobs) == 2 for c in content)
    assert content[0].bytes == list(content[0].token.encode())
    assert harness.fake.prefill_requests[0].sampling.logprobs == 2


async def test_completions_logprobs_shape(harness: Harness):
    client = harness.openai()
    result = await client.completions.create(model=MODEL, prompt="The quick", max_tokens=4, logprobs=2)
    logprobs = result.choices[0].logprobs
    tokens = [harness.tokenizer.decode([i]) for i in harness.fake.output_token_ids[:4]]
    assert logprobs.tokens == tokens
    assert logprobs.token_logprobs == [-0.5] * 4
    assert len(logprobs.top_logprobs) == 4 and all(len(t) <= 2 for t in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(4)]


async def test_block_hashes_and_cache_salt_from_heartbeats_and_key(model_dir: Path):
    h = await make_harness(model_dir, settings={"api_keys": ["sk-one"]})
    fingerprint = b"\x07" * 32
    for worker_id, role in (("prefill-0", WorkerRole.PREFILL), ("decode-0", WorkerRole.DECODE)):
        h.workers.observe(worker_load(worker_id, role, MODEL, model_fingerprint=fingerprint, block_size=16))
    long_text = "The quick brown fox jumps over the lazy dog. " * 2
    await h.openai("sk-one").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text}])
    salt = hashlib.sha256(b"sk-one").hexdigest()
    prompt_ids = h.tokenizer.encode_chat([{"role": "user", "content": long_text}])
    expected = hash_blocks(prompt_ids, 16, fingerprint, salt)
    assert len(expected) >= 2
    assert h.fake.route_requests[0].block_hashes == expected
    assert h.fake.route_requests[0].model_fingerprint == fingerprint
    assert h.fake.prefill_requests[0].cache_salt == salt
    # a body cache_salt narrows the key's: both hashed together
    await h.openai("sk-one").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": long_text}], extra_body={"cache_salt": "tenant-b"}
    )
    narrowed = hashlib.sha256(f"{salt}\0tenant-b".encode()).hexdigest()
    assert h.fake.route_requests[1].block_hashes == hash_blocks(prompt_ids, 16, fingerprint, narrowed)
    await h.fake.stop()


async def test_n_choices_with_derived_seeds(harness: Harness):
    client = harness.openai()
    result = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"], n=3, seed=10)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert all(c.message.content == ANSWER for c in result.choices)
    from deepinfer.sampling.seeds import derive_seed

    assert sorted(r.sampling.seed for r in harness.fake.decode_requests) == sorted(
        derive_seed(10, i) for i in range(3))
    assert result.usage.completion_tokens == 3 * len(harness.fake.output_token_ids)
    stream = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"], n=2, stream=True)
    texts = {0: "", 1: ""}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: ANSWER, 1: ANSWER}
    # Without a client seed the gateway draws one, so prefill and decode of a choice agree on it.
    assert all(r.sampling.seed is not None for r in harness.fake.decode_requests)


async def test_models_list_and_unknown(harness: Harness):
    models = await harness.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with harness.http() as http:
        response = await http.get("/v1/models/other")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x " * 200}]}, 400, "messages"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 1000}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT["messages"]}, 400, "model"),
        ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ],
)
async def test_invalid_requests_never_reach_a_worker(harness: Harness, path, body, status, param):
    async with harness.http() as http:
        response = await http.post(path, json=body)
    assert response.status_code == status, response.text
    error = _error(response)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert harness.fake.route_requests == []


async def test_bad_json_unknown_route_and_too_large(model_dir: Path):
    h = await make_harness(model_dir, settings={"max_request_bytes": 2000})
    async with h.http() as http:
        bad = await http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and _error(bad)["type"] == "invalid_request_error"
        missing = await http.get("/v1/nothing")
        assert missing.status_code == 404 and _error(missing)["code"] == "not_found"
        big = await http.post("/v1/chat/completions", json={**CHAT, "pad": "x" * 5000})
        assert big.status_code == 413 and _error(big)["code"] == "request_too_large"
    assert h.fake.route_requests == []


async def test_api_keys_guard_every_route(model_dir: Path):
    h = await make_harness(model_dir, settings={"api_keys": ["sk-good"]})
    async with h.http() as http:
        for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "Basic sk-good"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/nowhere")):
                response = await http.request(method, path, json=CHAT, headers=headers)
                assert response.status_code == 401, (headers, path)
                assert _error(response)["code"] == "invalid_api_key"
        ok = await http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-good"})
        assert ok.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        await h.openai("sk-bad").models.list()


async def test_overloaded_scheduler_is_503_with_retry_after(model_dir: Path):
    h = await make_harness(model_dir, overloaded=True)
    async with h.http() as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    assert _error(response)["type"] == "overloaded_error"


async def test_no_scheduler_is_fast_503(model_dir: Path):
    h = await make_harness(model_dir)
    await h.fake.stop()  # nobody answers on the route subject: NoResponders at once
    async with h.http() as http:
        response = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert "scheduler" in _error(response)["message"]


async def test_decode_refusal_is_503_and_cancels_the_prefill(model_dir: Path):
    h = await make_harness(model_dir, refuse_decode=ErrorCode.OVERLOADED)
    async with h.http() as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503 and "refused" in _error(response)["message"]
    await h.gateway.pipeline.tasks.drain(1.0)
    await h.fake.bus.broker.settle()
    # retried on another worker (the fake has one) within the migration budget, each attempt's prefill cancelled
    attempts = [r.request_id for r in h.fake.decode_requests]
    assert len(attempts) == 1 + h.gateway.settings.migration_budget
    assert [c.request_id for c in h.fake.cancels] == attempts
    assert all(r.exclude_worker_ids for r in h.fake.route_requests[1:])


async def test_decode_refusal_without_migration_is_503_at_once(model_dir: Path):
    h = await make_harness(model_dir, settings={"migration": False}, refuse_decode=ErrorCode.OVERLOADED)
    async with h.http() as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    await h.gateway.pipeline.tasks.drain(1.0)
    await h.fake.bus.broker.settle()
    assert [c.request_id for c in h.fake.cancels] == [h.fake.decode_requests[0].request_id]
    assert len(h.fake.decode_requests) == 1


async def test_metrics_count_requests(harness: Harness):
    async with harness.http() as http:
        await http.post("/v1/chat/completions", json=CHAT)
        await http.post("/v1/chat/completions", json={**CHAT, "n": 0})
    metrics = harness.state.metrics
    assert metrics.requests.labels("chat", "200")._value.get() == 1
    assert metrics.requests.labels("chat", "400")._value.get() == 1
    assert metrics.num_in_flight == 0
    assert metrics.output_tokens._value.get() == len(harness.fake.output_token_ids)


@pytest.mark.parametrize("dropped", [1, 2])
async def test_an_unanswered_route_is_asked_once_more_then_503(model_dir: Path, dropped: int):
    h = await make_harness(model_dir, settings={"route_timeout_s": 0.1}, drop_routes=dropped)
    response = await h.http().post("/v1/chat/completions", json=CHAT)
    await h.fake.stop()
    assert len(h.fake.route_requests) == 2
    if dropped == 1:  # the retry reached a live replica
        assert response.status_code == 200
    else:
        assert response.status_code == 503 and response.headers["retry-after"]
        assert "did not answer" in response.json()["error"]["message"]
