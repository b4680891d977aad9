"""A decode worker's per-step path on a real nats-server with a tiny model: token batches (published eagerly)
arrive complete and in order, KV event batches keep a gapless seq, and a load change is announced by a
heartbeat within LOAD_CHANGE_HEARTBEAT_S, not at the next periodic one."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from opentelemetry.trace import NoOpTracer

from deepinfer import subjects
from deepinfer.config import CommonSettings, DecodeSettings
from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.protocol import (
    Cancel,
    DecodeAccepted,
    DecodeRequest,
    DecodeStatus,
    KvEventBatch,
    TokenBatch,
    WireSamplingParams,
    WorkerLoad,
)
from deepinfer.sampling.params import SamplingParams as EngineSamplingParams
from deepinfer.service import ServiceContext
from deepinfer.telemetry import new_registry
from deepinfer.testing.checkpoints import make_tiny_checkpoint
from services.decode.handler import DecodeHandler
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

GATEWAY = "gw-steps"
PROMPTS = [[5 + i, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200 + i] for i in range(3)]
SAMPLING = WireSamplingParams(temperature=0, max_tokens=40, ignore_eos=True, seed=1)
#: Longer than the test: every heartbeat it sees after the first is one sent because the load changed.
PERIODIC_S = 60.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture
async def decode(nats_server, tiny_dir, tmp_path, bus):
    common = CommonSettings(nats_url=nats_server.url, nats_token=nats_server.token, model=str(tiny_dir),
                            model_cache_dir=tmp_path)
    handler = DecodeHandler(ServiceContext("decode", DecodeSettings(
        common=common, worker_id="decode-steps", block_size=4, internal_port=0, kv_store=False,
        heartbeat_interval_s=PERIODIC_S), bus, new_registry(), NoOpTracer()))
    await handler.load()
    yield handler
    await handler.close()


def reference(tiny_dir, prompt: list[int]) -> list[int]:
    core = EngineCore(EngineArgs(model=str(tiny_dir), block_size=4, progress=False))
    core.add_request("r", prompt, EngineSamplingParams(**SAMPLING.model_dump(exclude={"v"})))
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
    return tokens


async def test_batches_events_and_load_heartbeats_of_a_running_batch(decode, bus, tiny_dir):
    token = CommonSettings(model=str(tiny_dir)).model_token
    batches: list[TokenBatch] = []
    kv_seqs: list[int] = []
    beats: list[WorkerLoad] = []
    done = asyncio.Event()

    async def on_batch(batch: TokenBatch, msg) -> None:
        batches.append(batch)
        if sum(c.finish_reason is not None for b in batches for c in b.chunks) == len(PROMPTS):
            done.set()

    async def on_events(batch: KvEventBatch, msg) -> None:
        kv_seqs.append(batch.seq)

    async def on_beat(load: WorkerLoad, msg) -> None:
        beats.append(load)

    await bus.subscribe(subjects.tokens(token, GATEWAY), on_batch, message_type=TokenBatch)
    await bus.subscribe(subjects.kv_events(token, "decode-steps"), on_events, message_type=KvEventBatch)
    await bus.subscribe(subjects.heartbeat(token, "decode-steps"), on_beat, message_type=WorkerLoad)
    await decode.start()  # the first heartbeat: registered, idle
    replies = await asyncio.gather(*(bus.request(subjects.decode(token, "decode-steps"), DecodeRequest(
        request_id=f"r{i}", gateway_id=GATEWAY, prompt_token_ids=prompt, sampling=SAMPLING), DecodeAccepted,
        timeout_s=30) for i, prompt in enumerate(PROMPTS)))
    assert all(r.status is DecodeStatus.ACCEPTED for r in replies)
    await asyncio.wait_for(done.wait(), 30)
    # the load-change heartbeat of the finish; any beat but the first is one (PERIODIC_S outlasts the test)
    finished = (0, 0, len(PROMPTS))  # (running, waiting, received)
    await wait_until(lambda: (beats[-1].num_running, beats[-1].num_waiting, beats[-1].num_received) == finished,
                     "the finish's heartbeat")

    # Token batches: one per step, steps increasing; each request's chunks gapless and the reference's tokens.
    steps = [b.step for b in batches]
    assert steps == sorted(set(steps))
    for i, prompt in enumerate(PROMPTS):
        chunks = [c for b in batches for c in b.chunks if c.request_id == f"r{i}"]
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == reference(tiny_dir, prompt)
        assert [c.num_previous_tokens for c in chunks] == [sum(len(c.token_ids) for c in chunks[:k])
                                                           for k in range(len(chunks))]
    # KV events: every prompt and generated block was stored, seq gapless from 1.
    assert kv_seqs and kv_seqs == list(range(1, len(kv_seqs) + 1))

    # Heartbeats: besides the first (idle), the admissions and the finish were announced long before the
    # periodic one was due (PERIODIC_S: every beat after the first was sent because the load changed).
    assert beats[0].num_running == 0 and beats[0].num_received == 0
    loads = [(load.num_running, load.num_received) for load in beats[1:]]
    assert any(received == len(PROMPTS) for _, received in loads), loads
    assert loads[-1] == (0, len(PROMPTS))
    assert len(beats) < 20  # coalesced: at most one per LOAD_CHANGE_HEARTBEAT_S while the load moves


async def test_a_cancel_is_announced_by_a_heartbeat_though_no_step_follows(decode, bus, tiny_dir):
    token = CommonSettings(model=str(tiny_dir)).model_token
    beats: list[WorkerLoad] = []

    async def on_beat(load: WorkerLoad, msg) -> None:
        beats.append(load)

    await bus.subscribe(subjects.heartbeat(token, "decode-steps"), on_beat, message_type=WorkerLoad)
    await decode.start()
    long = WireSamplingParams(temperature=0, max_tokens=400, ignore_eos=True, seed=1)
    reply = await bus.request(subjects.decode(token, "decode-steps"), DecodeRequest(
        request_id="r-long", gateway_id=GATEWAY, prompt_token_ids=PROMPTS[0], sampling=long), DecodeAccepted,
        timeout_s=30)
    assert reply.status is DecodeStatus.ACCEPTED
    deadline_s = time.monotonic() + 10
    while not any(b.num_running == 1 for b in beats) and time.monotonic() < deadline_s:
        await asyncio.sleep(0.01)
    assert any(b.num_running == 1 for b in beats), beats
    await bus.publish(subjects.cancel(token), Cancel(request_id="r-long"))
    # The abort ran as an engine command, with no step after it: announced at once, not by the periodic beat
    # (PERIODIC_S outlasts the wait).
    await wait_until(lambda: beats[-1].num_running == 0, "a heartbeat announcing the cancel")


@pytest.mark.parametrize("token_spans", ["first_last", "all"])
async def test_a_traced_request_gets_its_chosen_token_batch_spans(nats_server, tiny_dir, tmp_path, bus, token_spans):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from deepinfer.telemetry.tracing import ServiceTracerProvider

    exporter = InMemorySpanExporter()
    provider = ServiceTracerProvider(token_spans)
    registry = new_registry()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    common = CommonSettings(nats_url=nats_server.url, nats_token=nats_server.token, model=str(tiny_dir),
                            model_cache_dir=tmp_path)
    handler = DecodeHandler(ServiceContext("decode", DecodeSettings(
        common=common, worker_id="decode-traced", block_size=4, internal_port=0, kv_store=False),
        bus, registry, provider.get_tracer("test")))
    await handler.load()
    await handler.start()
    try:
        token = CommonSettings(model=str(tiny_dir)).model_token
        tokens: list[int] = []
        headers: list[dict | None] = []
        done = asyncio.Event()

        async def on_batch(batch: TokenBatch, msg) -> None:
            headers.append(msg.headers)
            for chunk in batch.chunks:
                tokens.extend(chunk.token_ids)
                if chunk.finish_reason is not None:
                    done.set()

        await bus.subscribe(subjects.tokens(token, GATEWAY), on_batch, message_type=TokenBatch)
        reply = await bus.request(subjects.decode(token, "decode-traced"), DecodeRequest(
            request_id="r-traced", gateway_id=GATEWAY, prompt_token_ids=PROMPTS[0], sampling=SAMPLING),
            DecodeAccepted, timeout_s=30)
        assert reply.status is DecodeStatus.ACCEPTED
        await asyncio.wait_for(done.wait(), 30)
        await asyncio.sleep(0.2)
    finally:
        await handler.close()
    assert tokens == reference(tiny_dir, PROMPTS[0])
    assert headers == [None] * len(headers)  # a token batch carries no trace context: nothing injected per step
    spans = [s for s in exporter.get_finished_spans() if s.name == "decode.token_batch"]
    admission = next(s for s in exporter.get_finished_spans() if s.name == "decode.admission")
    steps = sorted(s.attributes["step"] for s in spans)
    if token_spans == "all":  # one per step, each with its one token
        assert len(spans) == SAMPLING.max_tokens and steps == list(range(steps[0], steps[0] + len(steps)))
    else:  # the first step's and the last's
        assert len(spans) == 2 and steps[1] - steps[0] == SAMPLING.max_tokens - 1
    assert all(s.attributes["num_tokens"] == 1 and s.end_time >= s.start_time for s in spans)
    assert {s.context.trace_id for s in spans} == {admission.context.trace_id}
    assert {s.parent.span_id for s in spans} == {admission.context.span_id}
    # every step's batch is in the hop histogram either way
    assert registry.get_sample_value("deepinfer_decode_hop_seconds_count", {"hop": "token_batch"}) == \
        SAMPLING.max_tokens


async def test_every_kind_of_chunk_is_the_models_bytes(decode, bus, tiny_dir):
    # The chunks the worker joins from fragments: a first one with cached tokens (the second request shares the
    # first's prompt), steady ones, logprobs on every chunk, a resumed request counting from its earlier
    # tokens, the last one with its finish reason. Each payload is exactly what the models would write.
    token = CommonSettings(model=str(tiny_dir)).model_token
    payloads: list[bytes] = []
    finished = asyncio.Event()

    async def on_batch(data: bytes, msg) -> None:
        payloads.append(data)
        chunks = [c for p in payloads for c in TokenBatch.from_bytes(p).chunks]
        if sum(c.finish_reason is not None for c in chunks) == 3:
            finished.set()

    await bus.subscribe(subjects.tokens(token, GATEWAY), on_batch)
    await decode.start()
    with_logprobs = SAMPLING.model_copy(update={"logprobs": 2, "max_tokens": 12})
    requests = [
        DecodeRequest(request_id="plain", gateway_id=GATEWAY, prompt_token_ids=PROMPTS[0], sampling=SAMPLING),
        DecodeRequest(request_id="logprobs", gateway_id=GATEWAY, prompt_token_ids=PROMPTS[0], sampling=with_logprobs),
        DecodeRequest(request_id="resumed", gateway_id=GATEWAY, prompt_token_ids=PROMPTS[1],
                      output_token_ids=[3, 4, 5], sampling=SAMPLING.model_copy(update={"max_tokens": 20})),
    ]
    for request in requests:  # one after the other: the second finds the first's prompt blocks cached
        reply = await bus.request(subjects.decode(token, "decode-steps"), request, DecodeAccepted, timeout_s=30)
        assert reply.status is DecodeStatus.ACCEPTED
    await asyncio.wait_for(finished.wait(), 30)

    for data in payloads:
        assert TokenBatch.from_bytes(data).to_bytes() == data
    chunks = {r.request_id: [c for p in payloads for c in TokenBatch.from_bytes(p).chunks
                             if c.request_id == r.request_id] for r in requests}
    for request_id, previous in (("plain", 0), ("logprobs", 0), ("resumed", 3)):
        first, *rest = chunks[request_id]
        assert first.num_cached_tokens is not None and first.cached_tokens_by_tier is not None
        assert all(c.num_cached_tokens is None and c.cached_tokens_by_tier is None for c in rest)
        assert [c.finish_reason is not None for c in chunks[request_id]] == [False] * len(rest) + [True]
        assert [c.num_previous_tokens for c in chunks[request_id]] == [
            previous + sum(len(c.token_ids) for c in chunks[request_id][:k]) for k in range(len(chunks[request_id]))]
    assert chunks["logprobs"][0].num_cached_tokens > 0
    assert all(c.logprobs is not None and [lp.token_id for lp in c.logprobs] == c.token_ids
               and all(len(lp.top) == 2 for lp in c.logprobs) for c in chunks["logprobs"])
    assert all(c.logprobs is None for c in chunks["plain"] + chunks["resumed"])


async def test_each_gateway_gets_one_batch_a_step_with_only_its_requests(decode, bus, tiny_dir):
    # A gateway's chunks go to a batch kept for it from step to step (emptied after each publish): two gateways'
    # requests decoding together, one finishing early, never leak into each other's batches or later steps.
    token = CommonSettings(model=str(tiny_dir)).model_token
    gateways = {"gw-a": ["a0", "a1"], "gw-b": ["b0"]}
    batches: dict[str, list[TokenBatch]] = {gateway: [] for gateway in gateways}
    finished = asyncio.Event()

    def on_batch_of(gateway: str):
        async def on_batch(data: bytes, msg) -> None:
            batch = TokenBatch.from_bytes(data)
            assert batch.to_bytes() == data
            batches[gateway].append(batch)
            if sum(c.finish_reason is not None for b in batches.values() for bb in b for c in bb.chunks) == 3:
                finished.set()
        return on_batch

    for gateway in gateways:
        await bus.subscribe(subjects.tokens(token, gateway), on_batch_of(gateway))
    await decode.start()
    max_tokens = {"a0": 30, "a1": 12, "b0": 30}
    replies = await asyncio.gather(*(bus.request(subjects.decode(token, "decode-steps"), DecodeRequest(
        request_id=request_id, gateway_id=gateway, prompt_token_ids=PROMPTS[i % len(PROMPTS)],
        sampling=SAMPLING.model_copy(update={"max_tokens": max_tokens[request_id]})), DecodeAccepted, timeout_s=30)
        for gateway, request_ids in gateways.items() for i, request_id in enumerate(request_ids)))
    assert all(r.status is DecodeStatus.ACCEPTED for r in replies)
    await asyncio.wait_for(finished.wait(), 30)

    for gateway, request_ids in gateways.items():
        steps = [b.step for b in batches[gateway]]
        assert steps == sorted(set(steps))  # one batch a step
        for batch in batches[gateway]:
            ids = [c.request_id for c in batch.chunks]
            assert set(ids) <= set(request_ids) and len(ids) == len(set(ids))
        for request_id in request_ids:
            chunks = [c for b in batches[gateway] for c in b.chunks if c.request_id == request_id]
            assert sum(len(c.token_ids) for c in chunks) == max_tokens[request_id]
            assert [c.finish_reason is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


async def test_young_collections_are_rare_once_loaded(decode):
    # After the load, the start-up objects are frozen and a young collection runs every GC_THRESHOLD_0
    # allocations, not Python's 700 (each one stopped the loop or the engine thread for ~100 µs).
    import gc

    from deepinfer.worker.runtime import GC_THRESHOLD_0

    assert gc.get_threshold()[0] == GC_THRESHOLD_0
    assert gc.get_freeze_count() > 0
