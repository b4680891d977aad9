"""Gateway migration (scripted workers): a stream whose decode worker goes silent resumes on a decode worker as
prompt + the tokens already sent; the client sees one stream. Shutdown past the drain grace ends every stream."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from deepinfer.protocol import WorkerRole
from deepinfer.testing.checkpoints import write_tokenizer_dir
from deepinfer.testing.fake_workers import worker_load
from tests.gateway_harness import ANSWER, MODEL, make_harness
from tests.waiting import wait_until

FAST = {"stream_timeout_s": 0.3, "first_token_timeout_s": 0.3, "poll_interval_s": 0.02, "retry_after_s": 0.05}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


async def _stream(client: openai.AsyncOpenAI, **kwargs) -> tuple[str, list[str | None], list]:
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    text, finishes, usages = "", [], []
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finishes.append(choice.finish_reason)
        if chunk.usage is not None:
            usages.append(chunk.usage)
    return text, [f for f in finishes if f is not None], usages


@pytest.mark.parametrize("stall_after", [1, 3, 9])
async def test_a_silent_decode_worker_is_replaced_mid_stream(model_dir: Path, stall_after: int):
    h = await make_harness(model_dir, settings=FAST, tokens_per_step=1, stall_after=stall_after, num_stalls=1)
    text, finishes, usages = await _stream(h.openai(), seed=7, temperature=0.8)
    assert text == ANSWER and finishes == ["stop"]
    assert len(usages) == 1 and usages[0].completion_tokens == len(h.fake.output_token_ids)
    first, resumed = h.fake.decode_requests
    assert resumed.request_id == f"{first.request_id}-m1"
    sent = first.output_token_ids + h.fake.output_token_ids[len(first.output_token_ids):stall_after]
    assert resumed.output_token_ids == sent  # what the client already has, as output (not as prompt)
    assert resumed.prompt_token_ids == first.prompt_token_ids
    assert resumed.sampling == first.sampling and resumed.sampling.seed == 7  # same seed, same budget
    assert resumed.kv_handle is None
    assert h.fake.route_requests[-1].exclude_worker_ids == ["decode-0"]
    await h.gateway.pipeline.tasks.drain(1.0)
    await h.fake.bus.broker.settle()
    assert [c.request_id for c in h.fake.cancels] == [first.request_id]  # the lost attempt only
    assert h.state.metrics.reissues.labels("migration")._value.get() == 1


async def test_a_chunk_lost_in_transit_is_a_gap_and_the_request_resumes_before_it(model_dir: Path):
    # the chunk at output position 4 never arrives (a NATS restart); position 5 shows the gap
    h = await make_harness(model_dir, settings={**FAST, "stream_timeout_s": 30.0}, tokens_per_step=1,
                           lose_chunk_at=4)
    text, finishes, usages = await _stream(h.openai())
    assert text == ANSWER and finishes == ["stop"]
    assert usages[0].completion_tokens == len(h.fake.output_token_ids)
    first, resumed = h.fake.decode_requests
    assert resumed.output_token_ids == h.fake.output_token_ids[:4]
    await h.gateway.pipeline.tasks.drain(1.0)
    await h.fake.bus.broker.settle()
    assert [c.request_id for c in h.fake.cancels] == [first.request_id]


def test_a_repeated_chunk_is_dropped_and_a_gap_breaks_the_stream():
    from deepinfer.protocol import TokenChunk
    from services.gateway.streams import RequestStream, TokenStreams

    stream = RequestStream(TokenStreams(None, MODEL, "gw"), "r", 1)  # type: ignore[arg-type]
    stream.put(TokenChunk(request_id="r", token_ids=[5, 6], num_previous_tokens=1))
    stream.put(TokenChunk(request_id="r", token_ids=[6], num_previous_tokens=2))  # a repeat
    assert stream.queue.qsize() == 1 and stream.next_position == 3 and stream.broken is None
    stream.put(TokenChunk(request_id="r", token_ids=[8], num_previous_tokens=4))  # position 3 never came
    assert stream.broken and stream.queue.qsize() == 1
    stream.put(TokenChunk(request_id="r", token_ids=[7], num_previous_tokens=3))  # too late: dropped
    assert stream.queue.qsize() == 1


async def test_a_seeded_request_without_a_seed_keeps_the_one_the_gateway_drew(model_dir: Path):
    h = await make_harness(model_dir, settings=FAST, tokens_per_step=1, stall_after=4, num_stalls=1)
    text, _, _ = await _stream(h.openai(), temperature=0.8)
    assert text == ANSWER
    first, resumed = h.fake.decode_requests
    assert first.sampling.seed is not None and resumed.sampling.seed == first.sampling.seed


async def test_a_stop_string_across_the_seam_still_stops(model_dir: Path):
    # "Hello, wo|rld": the stop string's first half came from the lost worker, its second from the new one
    h = await make_harness(model_dir, settings=FAST, tokens_per_step=1, num_stalls=1)
    tokenizer = h.tokenizer
    ids = h.fake.output_token_ids
    h.fake.stall_after = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("Hello, wo"))
    text, finishes, _ = await _stream(h.openai(), stop=["world"])
    assert text == "Hello, " and finishes == ["stop"]
    assert len(h.fake.decode_requests) == 2


async def test_a_non_streamed_request_is_migrated(model_dir: Path):
    h = await make_harness(model_dir, settings=FAST, tokens_per_step=1, stall_after=5, num_stalls=1)
    reply = await h.openai().chat.completions.create(model=MODEL, messages=MESSAGES)
    assert reply.choices[0].message.content == ANSWER and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(h.fake.output_token_ids)
    assert len(h.fake.decode_requests) == 2


async def test_a_prefill_worker_lost_before_its_reply_is_retried_elsewhere(model_dir: Path):
    # prefill-0 never answers (its gate stays shut until the end) and its heartbeats stop: the request is routed
    # again without it (decode computes it); the reply comes at all only by that retry
    gate = asyncio.Event()
    h = await make_harness(model_dir, settings={**FAST, "worker_lease_s": 0.2}, prefill_gate=gate)
    h.workers.observe(worker_load("prefill-0", WorkerRole.PREFILL, MODEL))  # seen once, then its lease lapses
    reply = await asyncio.wait_for(h.openai().chat.completions.create(model=MODEL, messages=MESSAGES), 30.0)
    assert reply.choices[0].message.content == ANSWER
    assert len(h.fake.prefill_requests) == 1  # the lost prefill's, never answered
    gate.set()  # now it may answer (to nobody), so the fake's handler ends
    first, retried = h.fake.route_requests
    assert retried.exclude_worker_ids == ["prefill-0"] and retried.request_id == f"{first.request_id}-m1"
    assert [r.request_id for r in h.fake.decode_requests] == [retried.request_id]
    assert h.fake.decode_requests[0].kv_handle is None
    await h.gateway.pipeline.tasks.drain(30.0)
    await h.fake.bus.broker.settle()
    assert [c.request_id for c in h.fake.cancels] == [first.request_id]  # the lost prefill is told to stop
    assert h.state.metrics.reissues.labels("start")._value.get() == 1


@pytest.mark.parametrize("wait_s", [5.0, 0.3])
async def test_a_migration_waits_for_a_worker_up_to_migration_wait_s(model_dir: Path, wait_s: float):
    # the lost worker's replacement is not there for 1.5 s (the scheduler answers overloaded meanwhile)
    h = await make_harness(model_dir, settings={**FAST, "migration_wait_s": wait_s}, tokens_per_step=1,
                           stall_after=3, num_stalls=1)

    async def outage() -> None:
        while not h.fake.decode_requests:
            await asyncio.sleep(0.01)
        h.fake.overloaded = True
        await asyncio.sleep(1.5)
        h.fake.overloaded = False

    task = asyncio.create_task(outage())
    if wait_s > 1.5:
        text, finishes, _ = await _stream(h.openai())
        assert text == ANSWER and finishes == ["stop"]
        assert len(h.fake.route_requests) > 3  # tried every retry_after_s until one took it
        assert len(h.fake.decode_requests) == 2
    else:
        with pytest.raises(openai.APIError, match="no tokens"):  # the loss, as today
            await _stream(h.openai())
        assert len(h.fake.decode_requests) == 1
    await task


async def test_a_spent_budget_ends_with_the_error_of_today(model_dir: Path):
    h = await make_harness(model_dir, settings={**FAST, "migration_budget": 2}, tokens_per_step=1, stall_after=3)
    async with h.http() as http:
        response = await http.post("/v1/chat/completions",
                                   json={"model": MODEL, "messages": MESSAGES, "stream": True})
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["type"] == "server_error" and "no tokens" in error["message"]
    assert len(h.fake.decode_requests) == 3  # the request, then 2 re-issues
    assert [r.request_id[-3:] for r in h.fake.decode_requests[1:]] == ["-m1", "-m2"]
    await h.gateway.pipeline.tasks.drain(1.0)
    await h.fake.bus.broker.settle()
    assert sorted(c.request_id for c in h.fake.cancels) == sorted(r.request_id for r in h.fake.decode_requests)


async def test_migration_off_ends_the_stream_at_the_first_loss(model_dir: Path):
    h = await make_harness(model_dir, settings={**FAST, "migration": False}, tokens_per_step=1, stall_after=3,
                           num_stalls=1)
    with pytest.raises(openai.APIError, match="no tokens"):
        await _stream(h.openai())
    assert len(h.fake.decode_requests) == 1


def _num_first_tokens(h) -> float:
    """Requests whose first token the gateway has seen (its TTFT histogram's count)."""
    return next((sample.value for metric in h.state.metrics.ttft_s.collect() for sample in metric.samples
                 if sample.name.endswith("_count") and sample.labels["route"] == "chat"), 0.0)


async def test_shutdown_past_the_grace_ends_every_request_with_an_error(model_dir: Path):
    # the workers never finish (they stall): the drain grace runs out with a stream and a plain request open
    h = await make_harness(model_dir, settings={"stream_timeout_s": 30.0, "poll_interval_s": 0.02},
                           tokens_per_step=1, stall_after=3)
    async with h.http() as http:
        body = {"model": MODEL, "messages": MESSAGES}
        streamed = asyncio.create_task(http.post("/v1/chat/completions", json={**body, "stream": True}))
        plain = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        # both have their first tokens (the stream has sent content) before the drain, whatever the machine's load
        await wait_until(lambda: _num_first_tokens(h) == 2, "both requests' first token")
        await asyncio.wait_for(h.gateway.drain(0.2), 5.0)
        streamed_response, plain_response = await asyncio.wait_for(asyncio.gather(streamed, plain), 1.0)
    events = [e for e in streamed_response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(events[-2][len("data: "):])["error"]["message"]
    assert '"content":"' in streamed_response.text  # it had started
    assert plain_response.status_code == 503 and "shutting down" in plain_response.json()["error"]["message"]
    await h.fake.bus.broker.settle()
    # drain flushed the Cancels (before the bus closes): every worker drops what it holds
    assert sorted(c.request_id for c in h.fake.cancels) == sorted(r.request_id for r in h.fake.decode_requests)
    assert len(h.fake.decode_requests) == 2  # nothing was migrated while shutting down
    assert h.state.metrics.num_in_flight == 0
