"""Gateway streams: stop strings across chunks, split UTF-8, silent/dead workers, client disconnect -> Cancel."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from starlette.requests import ClientDisconnect

from deepinfer.protocol import TokenBatch, TokenChunk, WorkerRole
from deepinfer.testing import FakeBus
from deepinfer.testing.checkpoints import write_tokenizer_dir
from deepinfer.testing.fake_workers import worker_load
from services.gateway.streams import TokenStreams
from tests.gateway_harness import MODEL, make_harness

#: Migration off: these tests are about how a failure ends a request (what a spent migration budget leaves).
FAST = {"stream_timeout_s": 0.5, "first_token_timeout_s": 0.5, "poll_interval_s": 0.05, "migration": False}
#: A silence limit no test outlives: a silent worker is not given up on, so only the path under test can end the
#: request (no wall-clock bound on how fast it does).
NEVER_S = 3600.0
#: How long a test waits for something that, with the code right, happens at once: only a broken path (waiting on a
#: worker that never answers) gets near it, however loaded the machine.
GENEROUS_S = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


async def _stream_text(client: openai.AsyncOpenAI, **kwargs) -> tuple[list[str], str | None]:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, **kwargs
    )
    deltas, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            finish = choice.finish_reason or finish
    return deltas, finish


async def test_stop_string_across_chunk_boundaries_cancels_the_workers(model_dir: Path):
    # "wo" and "rld" are separate tokens, each sent in its own TokenBatch: "world" spans two chunks.
    h = await make_harness(model_dir, output_text="Hello, world! How are you today?", tokens_per_step=1)
    deltas, finish = await _stream_text(h.openai(), stop=["world"])
    assert "".join(deltas) == "Hello, "
    assert finish == "stop"
    assert all("w" not in d for d in deltas)  # the partial stop string was held back, never sent
    await h.gateway.pipeline.tasks.drain(1.0)
    await h.fake.bus.broker.settle()
    assert [c.request_id for c in h.fake.cancels] == [h.fake.decode_requests[0].request_id]
    assert h.fake.cancels[0].reason == "stop string"
    # non-streamed, with the stop string kept
    result = await h.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stop="d!", extra_body={"include_stop_str_in_output": True}
    )
    assert result.choices[0].message.content == "Hello, world!"
    assert result.choices[0].finish_reason == "stop"


async def test_a_partial_stop_string_that_never_completes_is_sent_at_the_end(model_dir: Path):
    h = await make_harness(model_dir, output_text="Hello, world", tokens_per_step=1)
    deltas, finish = await _stream_text(h.openai(), stop=["world!"])
    assert "".join(deltas) == "Hello, world" and finish == "stop"
    assert h.fake.cancels == []


async def test_multibyte_characters_split_across_tokens(model_dir: Path):
    text = "é€😀 ok"
    h = await make_harness(model_dir, output_text=text, tokens_per_step=1)
    assert len(h.fake.output_token_ids) > len(text)  # byte-level: characters span several tokens
    deltas, _ = await _stream_text(h.openai())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


async def test_silent_stream_ends_with_an_error_event(model_dir: Path):
    # the worker goes silent for good after 3 tokens: only the gateway's silence limit (0.5 s) can end the stream
    h = await make_harness(model_dir, settings=FAST, tokens_per_step=1, stall_after=3)
    async with h.http() as http:
        response = await asyncio.wait_for(http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        ), GENEROUS_S)
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    # ended by the configured silence limit (its value is in the message), not a default or the request timeout
    assert error["type"] == "server_error" and "no tokens for 0.5 s" in error["message"]
    # the official client surfaces it as an APIError
    with pytest.raises(openai.APIError, match="no tokens"):
        await asyncio.wait_for(_stream_text(h.openai()), GENEROUS_S)
    # non-streamed: a 502 error object
    with pytest.raises(openai.APIStatusError) as info:
        await asyncio.wait_for(
            h.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]), GENEROUS_S)
    assert info.value.status_code == 502
    await h.gateway.pipeline.tasks.drain(GENEROUS_S)
    await h.fake.bus.broker.settle()
    assert len(h.fake.cancels) == 3  # each failed stream told the workers to drop it
    assert all(c.reason.startswith("gateway gave up") for c in h.fake.cancels)


async def test_dead_decode_worker_ends_the_stream_within_the_lease(model_dir: Path):
    settings = {"stream_timeout_s": 30.0, "first_token_timeout_s": 30.0, "poll_interval_s": 0.05,
                "worker_lease_s": 0.4, "migration": False}
    h = await make_harness(model_dir, settings=settings, tokens_per_step=1, stall_after=2)
    h.workers.observe(worker_load("decode-0", WorkerRole.DECODE, MODEL))  # seen once, then its lease lapses
    # the lease path answered ("heartbeats"): the only other end, the 30 s silence limit, says "no tokens"
    with pytest.raises(openai.APIError, match="stopped sending heartbeats"):
        await asyncio.wait_for(_stream_text(h.openai()), GENEROUS_S)


async def _drive_until_first_content(app, body: dict, spec_version: str) -> tuple[asyncio.Task, asyncio.Event]:
    """Run the ASGI app by hand; the client 'disconnects' once the first content chunk has arrived."""
    disconnect = asyncio.Event()
    got_content = asyncio.Event()
    payload = json.dumps(body).encode()
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if disconnect.is_set() and spec_version >= "2.4":
            raise OSError("client disconnected")  # what ASGI 2.4 servers do
        if message["type"] == "http.response.body" and b'"content":"' in message.get("body", b"") and (
            b'"content":""' not in message["body"]
        ):
            got_content.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("t", 1), "server": ("s", 80),
    }
    task = asyncio.create_task(app(scope, receive, send))
    await asyncio.wait_for(got_content.wait(), 5.0)
    disconnect.set()
    return task, disconnect


async def _post_and_hang_up(app, body: dict, hang_up: Callable[[], bool]) -> list[dict]:
    """POST `body` by hand over ASGI; the client hangs up once `hang_up()` is true (the request reached the phase
    under test). The messages the app sent; TimeoutError when the app does not end within GENEROUS_S."""
    payload = json.dumps(body).encode()
    sent: list[dict] = []
    state = {"sent": False}

    async def receive():  # as a server does: once it happened, the disconnect is handed over without waiting
        if not state["sent"]:
            state["sent"] = True
            return {"type": "http.request", "body": payload, "more_body": False}
        while not hang_up():
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("t", 1), "server": ("s", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), GENEROUS_S)
    return sent


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_a_request_whose_client_hangs_up_is_cancelled_on_every_worker(model_dir: Path, phase: str):
    # the workers never end the request on their own: a prefill that does not answer until the test is done (its
    # gate), or a decode that goes silent for good after 3 tokens (and no silence limit that ends it first): the app
    # ends at all only by the hang-up
    gate = asyncio.Event()
    if phase == "prefill":
        slow, reached = {"prefill_gate": gate}, lambda: bool(h.fake.prefill_requests)
    else:
        slow = {"tokens_per_step": 1, "step_delay_s": 0.02, "stall_after": 3}
        reached = lambda: bool(h.fake.decode_requests)  # noqa: E731
    settings = {"poll_interval_s": 0.05, "stream_timeout_s": NEVER_S}
    h = await make_harness(model_dir, output_text="Hello, world! " * 20, settings=settings, **slow)
    await _post_and_hang_up(h.app, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, reached)
    assert len(h.fake.decode_requests) == (0 if phase == "prefill" else 1)  # it ended in the phase under test
    gate.set()  # now the prefill may answer (to nobody), so the fake's handler ends
    await h.gateway.pipeline.tasks.drain(GENEROUS_S)
    await h.fake.bus.broker.settle()
    assert [c.request_id for c in h.fake.cancels] == [h.fake.prefill_requests[0].request_id]
    assert h.state.metrics.requests.labels("chat", "499")._value.get() == 1


# ASGI spec 2.3: Starlette listens for the disconnect and cancels the stream; 2.4: the gateway polls for it.
@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_client_disconnect_publishes_cancel(model_dir: Path, spec_version: str):
    # tokens flow, then the worker goes silent for good (no silence limit ends it): the stream never ends on its
    # own, so the app's task ends at all only by the disconnect
    h = await make_harness(model_dir, output_text="Hello, world! " * 5, settings={"stream_timeout_s": NEVER_S},
                           tokens_per_step=1, step_delay_s=0.05, stall_after=10)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    task, _ = await _drive_until_first_content(h.app, body, spec_version)
    with contextlib.suppress(ClientDisconnect):  # 2.4: the app lets the server see the failed send
        await asyncio.wait_for(task, GENEROUS_S)
    await h.gateway.pipeline.tasks.drain(GENEROUS_S)
    await h.fake.bus.broker.settle()
    assert [c.request_id for c in h.fake.cancels] == [h.fake.decode_requests[0].request_id]
    assert h.fake.cancels[0].reason == "client disconnected"
    assert h.state.metrics.num_in_flight == 0


async def test_token_streams_demultiplex_one_subject():
    bus = FakeBus()
    streams = TokenStreams(bus, MODEL, "gw-1")
    await streams.start()
    a, b = streams.open("req-a"), streams.open("req-b")
    batch = TokenBatch(worker_id="d", step=0, chunks=[
        TokenChunk(request_id="req-a", token_ids=[1]), TokenChunk(request_id="req-b", token_ids=[2]),
        TokenChunk(request_id="req-x", token_ids=[3]),
    ])
    await bus.publish(streams.subject, batch)
    await bus.broker.settle()
    assert (await a.get(1.0)).token_ids == [1]
    assert (await b.get(1.0)).token_ids == [2]
    assert await a.get(0.01) is None
    assert streams.num_dropped_chunks == 1
    with pytest.raises(ValueError):
        streams.open("req-a")
    a.close()
    assert streams.num_open == 1


async def test_a_waiting_get_wakes_on_the_next_chunk_and_leaves_no_timer_behind():
    streams = TokenStreams(FakeBus(), MODEL, "gw-1")
    stream = streams.open("r")
    waiting = asyncio.create_task(stream.get(5.0))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    await streams.on_batch(TokenBatch(worker_id="d", step=0, chunks=[TokenChunk(request_id="r", token_ids=[4])]))
    # the chunk itself wakes the wait: done within a few turns of the loop (no clock involved), where waking on its
    # 5 s timer would take 5 s of turns
    for _ in range(10):
        if waiting.done():
            break
        await asyncio.sleep(0)
    assert waiting.done() and waiting.result().token_ids == [4]
    assert await stream.get(0.02) is None  # the first wait's 5 s timer is gone; this one expires on its own
    cancelled = asyncio.create_task(stream.get(5.0))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await streams.on_batch(TokenBatch(worker_id="d", step=1, chunks=[TokenChunk(request_id="r", token_ids=[5])]))
    assert (await stream.get(0.5)).token_ids == [5]  # a cancelled wait loses nothing


async def test_a_lagging_stream_gets_every_queued_step_as_one_chunk():
    from deepinfer.protocol import ErrorCode, ErrorDetail, FinishReason, TokenLogprobs

    streams = TokenStreams(FakeBus(), MODEL, "gw-1")
    stream = streams.open("r")
    lp = [TokenLogprobs(token_id=t, logprob=-float(t)) for t in range(6)]
    for step, (ids, finish) in enumerate([([1], None), ([2, 3], None), ([4], FinishReason.LENGTH), ([5], None)]):
        chunk = TokenChunk(request_id="r", token_ids=ids, logprobs=lp[ids[0]:ids[-1] + 1], finish_reason=finish,
                           num_cached_tokens=16 if step == 0 else None)
        await streams.on_batch(TokenBatch(worker_id="d", step=step, chunks=[chunk]))
    merged = await stream.get(1.0)  # the steps that arrived meanwhile, up to the end of the request
    assert merged.token_ids == [1, 2, 3, 4] and merged.finish_reason is FinishReason.LENGTH
    assert [x.token_id for x in merged.logprobs] == [1, 2, 3, 4] and merged.num_cached_tokens == 16
    assert (await stream.get(1.0)).token_ids == [5]  # nothing is merged across a finish
    error = ErrorDetail(code=ErrorCode.INTERNAL, message="x")
    for chunk in (TokenChunk(request_id="r", token_ids=[6], error=error), TokenChunk(request_id="r", token_ids=[7])):
        await streams.on_batch(TokenBatch(worker_id="d", step=9, chunks=[chunk]))
    assert (await stream.get(1.0)).error == error  # nor across an error


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_request_timeout_is_a_504_or_an_error_event_and_cancels(model_dir: Path, phase: str):
    # the workers never end the request on their own (a prefill that does not answer until the test is done; a
    # decode silent for good after 3 tokens, no silence limit): only the request timeout can, and a 504 proves it did
    gate = asyncio.Event()
    slow = ({"prefill_gate": gate} if phase == "prefill"
            else {"step_delay_s": 0.05, "tokens_per_step": 1, "stall_after": 3})
    settings = {"request_timeout_s": 0.4, "poll_interval_s": 0.05, "stream_timeout_s": NEVER_S}
    h = await make_harness(model_dir, output_text="Hello, world! How are you today? " * 4, settings=settings, **slow)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        await asyncio.wait_for(
            h.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]), GENEROUS_S)
    assert info.value.status_code == 504 and info.value.body["code"] == "timeout"
    assert time.monotonic() - started >= 0.4  # never before its timeout (load only makes it later)
    if phase == "prefill":
        assert h.fake.decode_requests == []  # answered while the prefill was still pending
    if phase == "decode":  # a stream that already started ends with an error event
        with pytest.raises(openai.APIError, match="request_timeout_s"):
            await asyncio.wait_for(_stream_text(h.openai()), GENEROUS_S)
    gate.set()  # now the prefill may answer (to nobody), so the fake's handler ends
    await h.gateway.pipeline.tasks.drain(GENEROUS_S)
    await h.fake.bus.broker.settle()
    # every request that reached a worker was cancelled on all of them
    reached = {r.request_id for r in h.fake.prefill_requests}
    assert reached and {c.request_id for c in h.fake.cancels} == reached


@pytest.mark.parametrize("token_spans", ["first_last", "all"])
async def test_a_traced_request_has_one_root_a_span_per_hop_and_its_chosen_sse_writes(
        model_dir: Path, tmp_path: Path, token_spans: str):
    from deepinfer.config import CommonSettings
    from deepinfer.telemetry import setup_tracer_provider
    from deepinfer.telemetry.trace_file import read_spans

    provider = setup_tracer_provider(
        CommonSettings(otel_exporter="file", otel_file_dir=tmp_path, otel_token_spans=token_spans), "gateway")
    h = await make_harness(model_dir, tracer=provider.get_tracer("gateway"), tokens_per_step=2)
    deltas, _ = await _stream_text(h.openai())
    provider.shutdown()
    spans = read_spans(tmp_path)
    (root,) = [s for s in spans if s["name"] == "gateway.request"]
    assert root["parent_id"] is None and root["attributes"]["http.response.status_code"] == 200
    children = [s for s in spans if s["parent_id"] == root["span_id"]]
    names = sorted({s["name"] for s in children})
    assert names == ["gateway.decode_admission", "gateway.prefill", "gateway.route", "gateway.sse_write",
                     "gateway.tokenize"]
    writes = sorted((s for s in children if s["name"] == "gateway.sse_write"), key=lambda s: s["start_ns"])
    # every write (each delta's, then the closing one: usage and [DONE]) is in the histogram, either way
    num_writes = next(sample.value for metric in h.gateway.state.hops.seconds.collect() for sample in metric.samples
                      if sample.name.endswith("_count") and sample.labels["hop"] == "sse_write")
    assert num_writes >= len(deltas) + 1
    if token_spans == "all":
        assert len(writes) == num_writes
    else:  # the first (the first token's) and the last (the closing events), nothing between
        assert len(writes) == 2
        decode_admission = next(s for s in children if s["name"] == "gateway.decode_admission")
        # guaranteed, not a race: the admission ends before the request's task hands over its stream, and a write
        # span's monotonic readings are shifted by an offset read as it is recorded (Hops.record_span)
        assert writes[0]["start_ns"] >= decode_admission["end_ns"]
    assert all(s["trace_id"] == root["trace_id"] for s in spans)
    # the root starts before its hops and ends after the stream's last write, in this one process
    assert all(root["start_ns"] <= s["start_ns"] <= s["end_ns"] <= root["end_ns"] for s in children)


async def test_an_untraced_request_creates_no_per_token_spans(model_dir: Path, monkeypatch):
    h = await make_harness(model_dir, tokens_per_step=1)
    recorded: list[str] = []
    monkeypatch.setattr(h.gateway.state.hops, "record", lambda hop, *a, **k: recorded.append(hop))
    deltas, _ = await _stream_text(h.openai())
    assert len(deltas) > 3 and recorded == []  # not one sse_write span: the stream checks is_recording() once
