"""Prefill and decode handlers on a real nats-server with a tiny model: the handoff over the data plane, and
what happens when it cannot be used (layout mismatch, expired lease, cancel)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from opentelemetry.trace import NoOpTracer

from deepinfer import subjects
from deepinfer.config import CommonSettings, DecodeSettings, PrefillSettings
from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.protocol import (
    Cancel,
    DecodeAccepted,
    DecodeRequest,
    DecodeStatus,
    ErrorCode,
    FinishReason,
    PrefillRequest,
    PrefillResult,
    TokenBatch,
    WireSamplingParams,
)
from deepinfer.sampling.params import SamplingParams
from deepinfer.service import ServiceContext
from deepinfer.telemetry import new_registry
from deepinfer.testing.checkpoints import make_tiny_checkpoint
from services.decode.handler import DecodeHandler
from services.prefill.handler import PrefillHandler
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300, 6, 70]  # 21 tokens
GATEWAY = "gw-test"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def common(nats_server, tiny_dir, tmp_path) -> CommonSettings:
    return CommonSettings(
        nats_url=nats_server.url, nats_token=nats_server.token, model=str(tiny_dir),
        data_plane_secret="d" * 32, model_cache_dir=tmp_path,
    )


async def start(handler) -> None:
    await handler.load()
    await handler.start()


@pytest.fixture
async def workers(nats_server, tiny_dir, tmp_path, bus):
    shared = common(nats_server, tiny_dir, tmp_path)
    prefill = PrefillHandler(ServiceContext("prefill", PrefillSettings(
        common=shared, worker_id="prefill-t", block_size=4, data_plane_port=0, internal_port=0, kv_lease_s=0.5),
        bus, new_registry(), NoOpTracer()))
    decode = DecodeHandler(ServiceContext("decode", DecodeSettings(
        common=shared, worker_id="decode-t", block_size=4, internal_port=0), bus, new_registry(), NoOpTracer()))
    await asyncio.gather(start(prefill), start(decode))
    yield prefill, decode
    await asyncio.gather(prefill.close(), decode.close())


def reference(tiny_dir, params: SamplingParams) -> list[int]:
    core = EngineCore(EngineArgs(model=str(tiny_dir), block_size=4, progress=False))
    core.add_request("r", PROMPT, params)
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
    return tokens


async def run_request(bus, prefill_id: str | None, sampling: WireSamplingParams, request_id: str, mutate=None,
                      wait_before_decode_s: float = 0.0, resume_from: list[int] | None = None):
    """Drive one request like the gateway: prefill → decode → collect the token stream (`resume_from`: the
    tokens a lost worker already sent, as a migrated request carries them)."""
    chunks: list = []
    done = asyncio.Event()

    async def on_batch(batch: TokenBatch, msg) -> None:
        for chunk in batch.chunks:
            if chunk.request_id == request_id:
                chunks.append(chunk)
                if chunk.finish_reason is not None:
                    done.set()

    token = MODEL_TOKEN["value"]
    sub = await bus.subscribe(subjects.tokens(token, GATEWAY), on_batch, message_type=TokenBatch)
    first, handle = list(resume_from or []), None
    if prefill_id is not None:
        result = await bus.request(subjects.prefill(token, prefill_id), PrefillRequest(
            request_id=request_id, gateway_id=GATEWAY, prompt_token_ids=PROMPT, sampling=sampling),
            PrefillResult, timeout_s=30)
        assert result.error is None, result.error
        first, handle = [result.first_token_id], result.kv_handle
    if mutate is not None:
        handle = mutate(handle)
    await asyncio.sleep(wait_before_decode_s)
    accepted = await bus.request(subjects.decode(token, "decode-t"), DecodeRequest(
        request_id=request_id, gateway_id=GATEWAY, prompt_token_ids=PROMPT, output_token_ids=first,
        sampling=sampling, kv_handle=handle, prefill_worker_id=prefill_id), DecodeAccepted, timeout_s=30)
    if accepted.status is DecodeStatus.ACCEPTED:
        await asyncio.wait_for(done.wait(), 30)
    await sub.unsubscribe()
    return accepted, first + [t for c in chunks for t in c.token_ids]


MODEL_TOKEN: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _model_token(tiny_dir):
    MODEL_TOKEN["value"] = CommonSettings(model=str(tiny_dir)).model_token


GREEDY = WireSamplingParams(temperature=0, max_tokens=10, ignore_eos=True, seed=1)
SEEDED = WireSamplingParams(temperature=0.9, top_k=30, max_tokens=10, ignore_eos=True, seed=77)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_handoff_over_the_data_plane_equals_one_engine(workers, bus, tiny_dir, sampling):
    prefill, decode = workers
    accepted, tokens = await run_request(bus, "prefill-t", sampling, f"r-{sampling.temperature}")
    assert accepted.status is DecodeStatus.ACCEPTED
    assert tokens == reference(tiny_dir, SamplingParams(**sampling.model_dump(exclude={"v"})))
    assert decode._requests.labels("pulled")._value.get() == 1
    # The decode worker's Release ended the lease: nothing stays held on the prefill worker.
    for _ in range(50):
        if not prefill._leases:
            break
        await asyncio.sleep(0.05)
    assert not prefill._leases


async def test_layout_mismatch_is_refused(workers, bus):
    def other_layout(handle):
        layout = handle.layout.model_copy(update={"dtype": "float16"})
        return handle.model_copy(update={"layout": layout, "layout_id": layout.layout_id()})

    accepted, _ = await run_request(bus, "prefill-t", GREEDY, "r-layout", mutate=other_layout)
    assert accepted.status is DecodeStatus.REFUSED
    assert accepted.error.code is ErrorCode.LAYOUT_MISMATCH


async def test_invalid_values_are_refused_with_typed_codes(workers, bus, tiny_dir):
    token = MODEL_TOKEN["value"]
    # Valid on the wire, invalid for the engine: min_tokens above max_tokens.
    bad = WireSamplingParams(temperature=0, max_tokens=2, min_tokens=5)
    for worker, request_type, reply_type in (("prefill", PrefillRequest, PrefillResult),
                                             ("decode", DecodeRequest, DecodeAccepted)):
        subject = subjects.prefill(token, "prefill-t") if worker == "prefill" else subjects.decode(token, "decode-t")
        reply = await bus.request(subject, request_type(
            request_id=f"r-bad-{worker}", gateway_id=GATEWAY, prompt_token_ids=PROMPT, sampling=bad), reply_type,
            timeout_s=30)
        assert reply.error is not None and reply.error.code is ErrorCode.BAD_REQUEST, reply
        assert "min_tokens" in reply.error.message
    too_long = list(PROMPT) * 100  # past the tiny model's context length
    reply = await bus.request(subjects.decode(token, "decode-t"), DecodeRequest(
        request_id="r-long", gateway_id=GATEWAY, prompt_token_ids=too_long, sampling=GREEDY), DecodeAccepted,
        timeout_s=30)
    assert reply.status is DecodeStatus.REFUSED and reply.error.code is ErrorCode.CONTEXT_LENGTH


async def test_expired_lease_recomputes_the_prompt(workers, bus, tiny_dir):
    _, decode = workers
    accepted, tokens = await run_request(bus, "prefill-t", GREEDY, "r-expired", wait_before_decode_s=1.0)
    assert accepted.status is DecodeStatus.ACCEPTED
    assert tokens == reference(tiny_dir, SamplingParams(**GREEDY.model_dump(exclude={"v"})))
    assert decode._requests.labels("recomputed")._value.get() == 1


async def test_decode_without_prefill_computes_the_prompt(workers, bus, tiny_dir):
    _, decode = workers
    accepted, tokens = await run_request(bus, None, GREEDY, "r-local")
    assert accepted.status is DecodeStatus.ACCEPTED
    assert tokens == reference(tiny_dir, SamplingParams(**GREEDY.model_dump(exclude={"v"})))
    assert decode._requests.labels("local")._value.get() == 1


async def test_prompt_logprobs_come_from_the_worker_that_computed_the_prompt(workers, bus, tiny_dir):
    """prompt_logprobs: in the PrefillResult when a prefill worker computed the prompt, on the first TokenChunk
    when the decode worker did (and on no other chunk); the offline engine's numbers either way."""
    sampling = WireSamplingParams(temperature=0, max_tokens=3, ignore_eos=True, seed=1, prompt_logprobs=2)
    core = EngineCore(EngineArgs(model=str(tiny_dir), block_size=4, progress=False))
    core.add_request("r", PROMPT, SamplingParams(**sampling.model_dump(exclude={"v"})))
    expected = next(out.prompt_logprobs for out in core.step() if out.prompt_logprobs is not None)
    token = MODEL_TOKEN["value"]

    def check(scores) -> None:
        assert scores is not None and len(scores.logprobs) == len(PROMPT) - 1
        # float32 logprobs of ~-14 differ in their last bits between batch shapes: 1e-5 relative, as well
        assert scores.logprobs == pytest.approx(expected.logprobs, rel=1e-5, abs=1e-5)
        assert scores.ranks == expected.ranks and scores.top_token_ids == expected.top_token_ids

    result = await bus.request(subjects.prefill(token, "prefill-t"), PrefillRequest(
        request_id="r-plp-prefill", gateway_id=GATEWAY, prompt_token_ids=PROMPT, sampling=sampling),
        PrefillResult, timeout_s=30)
    check(result.prompt_logprobs)
    chunks: list = []
    done = asyncio.Event()

    async def on_batch(batch: TokenBatch, msg) -> None:
        chunks.extend(c for c in batch.chunks if c.request_id == "r-plp-decode")
        if chunks and chunks[-1].finish_reason is not None:
            done.set()

    sub = await bus.subscribe(subjects.tokens(token, GATEWAY), on_batch, message_type=TokenBatch)
    accepted = await bus.request(subjects.decode(token, "decode-t"), DecodeRequest(
        request_id="r-plp-decode", gateway_id=GATEWAY, prompt_token_ids=PROMPT, sampling=sampling), DecodeAccepted,
        timeout_s=30)
    assert accepted.status is DecodeStatus.ACCEPTED
    await asyncio.wait_for(done.wait(), 30)
    await sub.unsubscribe()
    check(chunks[0].prompt_logprobs)
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    assert [t for c in chunks for t in c.token_ids][:1] == [result.first_token_id]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_resumed_request_continues_as_the_lost_worker_would_have(workers, bus, tiny_dir, sampling):
    # A migrated request: prompt + the 4 tokens the lost worker sent, no KV; the rest is the uninterrupted run's.
    expected = reference(tiny_dir, SamplingParams(**sampling.model_dump(exclude={"v"})))
    accepted, tokens = await run_request(bus, None, sampling, f"r-resume-{sampling.temperature}",
                                         resume_from=expected[:4])
    assert accepted.status is DecodeStatus.ACCEPTED
    assert tokens == expected and len(tokens) == sampling.max_tokens  # max_tokens counts the resumed ones


async def test_a_resumed_request_replays_its_grammar(workers, bus, tiny_dir):
    # structured output: the worker replays the grammar over the tokens sent, then continues as uninterrupted
    from deepinfer.structured import json_schema_grammar

    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    sampling = WireSamplingParams(temperature=0.9, top_k=30, max_tokens=12, seed=5, grammar=grammar)
    expected = reference(tiny_dir, SamplingParams(**sampling.model_dump(exclude={"v"})))
    assert len(expected) > 4
    accepted, tokens = await run_request(bus, None, sampling, "r-resume-grammar", resume_from=expected[:4])
    assert accepted.status is DecodeStatus.ACCEPTED
    assert tokens == expected


async def _wait_idle(decode) -> None:
    for _ in range(100):
        await decode.runtime.heartbeat()
        stats = decode.runtime.stats
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return
        await asyncio.sleep(0.05)


async def test_drain_past_the_grace_aborts_and_tells_the_gateway(workers, bus):
    _, decode = workers
    token = MODEL_TOKEN["value"]
    chunks: list = []

    async def on_batch(batch: TokenBatch, msg) -> None:
        chunks.extend(batch.chunks)

    await bus.subscribe(subjects.tokens(token, GATEWAY), on_batch, message_type=TokenBatch)
    long = WireSamplingParams(temperature=0, max_tokens=400, ignore_eos=True, seed=1)
    accepted = await bus.request(subjects.decode(token, "decode-t"), DecodeRequest(
        request_id="r-drain", gateway_id=GATEWAY, prompt_token_ids=PROMPT, sampling=long), DecodeAccepted,
        timeout_s=30)
    assert accepted.status is DecodeStatus.ACCEPTED
    await wait_until(lambda: chunks, "the request's first tokens")  # it is generating
    await asyncio.wait_for(decode.drain(0.2), 5.0)
    await wait_until(lambda: chunks[-1].finish_reason is not None, "the request's last chunk")
    last = chunks[-1]
    assert last.request_id == "r-drain" and last.finish_reason is FinishReason.ERROR
    assert last.error is not None and last.error.code is ErrorCode.OVERLOADED and "drain grace" in last.error.message
    assert 0 < sum(len(c.token_ids) for c in chunks) < 400  # it was generating, and stopped
    await _wait_idle(decode)
    assert decode.runtime.stats.num_running == 0
    assert decode.runtime.stats.num_free_blocks == decode.runtime.stats.num_total_blocks


async def test_cancel_stops_decoding_and_frees_blocks(workers, bus):
    _, decode = workers
    long = WireSamplingParams(temperature=0, max_tokens=400, ignore_eos=True, seed=1)
    token = MODEL_TOKEN["value"]
    accepted = await bus.request(subjects.decode(token, "decode-t"), DecodeRequest(
        request_id="r-cancel", gateway_id=GATEWAY, prompt_token_ids=PROMPT, sampling=long), DecodeAccepted,
        timeout_s=30)
    assert accepted.status is DecodeStatus.ACCEPTED
    await asyncio.sleep(0.2)
    await bus.publish(subjects.cancel(token), Cancel(request_id="r-cancel"))
    for _ in range(100):
        await decode.runtime.heartbeat()
        stats = decode.runtime.stats
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks:
            break
        await asyncio.sleep(0.05)
    assert decode.runtime.stats.num_running == 0
    assert decode.runtime.stats.num_free_blocks == decode.runtime.stats.num_total_blocks


async def test_workers_publish_kv_events_with_the_prompt_block_hashes(workers, bus, tiny_dir):
    from deepinfer.hashing import hash_blocks
    from deepinfer.protocol import KvEventBatch, KvEventKind

    prefill, _ = workers
    token = MODEL_TOKEN["value"]
    batches: list[KvEventBatch] = []

    async def on_events(batch: KvEventBatch, msg) -> None:
        batches.append(batch)

    sub = await bus.subscribe(subjects.kv_events_all(token), on_events, message_type=KvEventBatch)
    accepted, _ = await run_request(bus, "prefill-t", GREEDY, "r-events")
    assert accepted.status is DecodeStatus.ACCEPTED
    expected = hash_blocks(PROMPT, 4, prefill.runtime.engine.fingerprint, "")

    def stored() -> set[tuple[str, bytes]]:
        return {(batch.worker_id, h) for batch in batches for event in batch.events
                if event.event_kind is KvEventKind.STORED for h in event.block_hashes}

    # Both workers announce the prompt's full blocks: prefill computed them, decode imported them.
    announced = {(worker, h) for worker in ("prefill-t", "decode-t") for h in expected}
    await wait_until(lambda: announced <= stored(), "both workers' stored events for the prompt")
    await sub.unsubscribe()
    for worker in ("prefill-t", "decode-t"):
        seqs = [b.seq for b in batches if b.worker_id == worker]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


async def test_snapshot_pages_are_cut_at_the_event_seq_and_match_the_stream(workers, bus, tiny_dir):
    """A KvIndex fed only by the prefill worker's events and one fed only by its paged snapshot agree."""
    from deepinfer.hashing import hash_blocks
    from deepinfer.protocol import KvEventBatch, SnapshotPage, SnapshotRequest
    from services.scheduler.kv_index import KvIndex

    prefill, _ = workers
    token, epoch = MODEL_TOKEN["value"], prefill.runtime.epoch
    from_events = KvIndex()
    from_events.observe_worker("prefill-t", "L", epoch)
    assert from_events.begin_snapshot("prefill-t")  # an empty snapshot at seq 0: the events start at 1
    assert from_events.apply_page(SnapshotPage(worker_id="prefill-t", seq=0, epoch=epoch))
    assert from_events.end_snapshot("prefill-t")
    seen: list[KvEventBatch] = []

    async def on_events(batch: KvEventBatch, msg) -> None:
        if batch.worker_id == "prefill-t":
            seen.append(batch)
            assert from_events.apply_batch(batch) is False  # no gap, same epoch

    sub = await bus.subscribe(subjects.kv_events(token, "prefill-t"), on_events, message_type=KvEventBatch)
    accepted, _ = await run_request(bus, "prefill-t", GREEDY, "r-snapshot")
    assert accepted.status is DecodeStatus.ACCEPTED
    from_pages = KvIndex()
    from_pages.observe_worker("prefill-t", "L", epoch)
    from_pages.begin_snapshot("prefill-t")
    request, pages = SnapshotRequest(page_size=2), []
    while True:
        page = await bus.request(subjects.snapshot(token, "prefill-t"), request, SnapshotPage, timeout_s=10)
        assert from_pages.apply_page(page)
        pages.append(page)
        if page.next_cursor is None:
            break
        request = SnapshotRequest(cursor=page.next_cursor, seq=page.seq, page_size=2)
    assert from_pages.end_snapshot("prefill-t")
    # every batch up to the snapshot's seq has arrived (the worker publishes its events in the background)
    await wait_until(lambda: seen and seen[-1].seq >= pages[0].seq, "the events up to the snapshot's seq")
    await sub.unsubscribe()
    expected = hash_blocks(PROMPT, 4, prefill.runtime.engine.fingerprint, "")
    assert len(pages) == 3 and {p.seq for p in pages} == {seen[-1].seq} and {p.epoch for p in pages} == {epoch}
    assert [p.cursor for p in pages] == [0, 2, 4]
    assert sorted(b for p in pages for b in p.block_hashes) == sorted(expected)
    for block_hash in expected:
        assert from_pages.holders("L", block_hash) == from_events.holders("L", block_hash) == {"prefill-t": "device"}
    assert from_pages.num_entries == from_events.num_entries == len(expected)


async def test_load_is_exported_under_the_model_server_protocol_names(workers, bus):
    from prometheus_client import generate_latest

    prefill, decode = workers
    await decode.runtime.heartbeat()
    text = generate_latest(decode.ctx.registry).decode()
    stats = decode.runtime.stats
    usage = 1 - stats.num_free_blocks / stats.num_total_blocks
    assert f"vllm:num_requests_running {float(stats.num_running)}" in text
    assert f"vllm:num_requests_waiting {float(stats.num_waiting)}" in text
    assert f"vllm:kv_cache_usage_perc {float(usage)}" in text
    assert f"vllm:gpu_cache_usage_perc {float(usage)}" in text
