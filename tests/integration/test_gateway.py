"""The gateway app over a real nats-server, with scripted scheduler/prefill/decode responders on NATS."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from deepinfer.bus import Bus
from deepinfer.nats_server import NatsServer
from deepinfer.telemetry import serve_internal
from deepinfer.testing.checkpoints import write_tokenizer_dir
from tests.gateway_harness import ANSWER, MODEL, Harness, make_harness

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture
async def harness(nats_server: NatsServer, model_dir: Path) -> AsyncIterator[Harness]:
    gateway_bus = await Bus.connect(nats_server.url, name="gateway", token=nats_server.token)
    worker_bus = await Bus.connect(nats_server.url, name="workers", token=nats_server.token)
    h = await make_harness(
        model_dir, gateway_bus=gateway_bus, worker_bus=worker_bus, num_cached_tokens=32, tokens_per_step=3
    )
    await gateway_bus.flush()
    yield h
    await h.fake.stop()
    await h.gateway.close()
    await gateway_bus.close()
    await worker_bus.close()


MESSAGES = [{"role": "user", "content": "Hi there"}]


async def test_chat_non_stream_and_stream(harness: Harness):
    client = harness.openai()
    result = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert result.choices[0].message.content == ANSWER
    assert result.usage.prompt_tokens_details.cached_tokens == 32
    assert result.usage.completion_tokens == len(harness.fake.output_token_ids)
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32


async def test_completions(harness: Harness):
    result = await harness.openai().completions.create(model=MODEL, prompt="The quick", max_tokens=4)
    assert result.choices[0].text == harness.tokenizer.decode(harness.fake.output_token_ids[:4])
    assert result.choices[0].finish_reason == "length"


async def test_no_scheduler_is_a_fast_503(harness: Harness):
    await harness.fake.stop()
    with pytest.raises(openai.APIStatusError) as info:
        await harness.openai().chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.status_code == 503
    # NoResponders (the server answers at once), not the route timeout ("the scheduler did not answer")
    assert "no scheduler is available" in info.value.message


async def test_client_disconnect_sends_cancel_over_nats(harness: Harness):
    harness.fake.output_token_ids = harness.fake.output_token_ids * 10
    harness.fake.tokens_per_step, harness.fake.step_delay_s = 1, 0.05
    server = await serve_internal(harness.app, "127.0.0.1", 0)
    try:
        body = {"model": MODEL, "messages": MESSAGES, "stream": True}
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            async for line in response.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break  # got a token; leaving the block closes the connection
        for _ in range(100):
            if harness.fake.cancels:
                break
            await asyncio.sleep(0.02)
        assert [c.request_id for c in harness.fake.cancels] == [harness.fake.decode_requests[0].request_id]
    finally:
        await server.stop()
