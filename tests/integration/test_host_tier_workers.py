"""A decode worker with its host-memory KV tier on (CPU, forced on by kv_host_cache_bytes) and a small device pool,
on a real nats-server with a tiny model: a prompt evicted from the device comes back from the host tier (usage
reports "host" tokens, greedy output identical to a recompute), and the scheduler's KV index learns the host tier
from the worker's KV events and its snapshot."""

from __future__ import annotations

import asyncio

import pytest
import torch
from opentelemetry.trace import NoOpTracer

from deepinfer import subjects
from deepinfer.config import CommonSettings, DecodeSettings
from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.hashing import hash_blocks
from deepinfer.protocol import (
    KvEventBatch,
    KvTier,
    SnapshotPage,
    SnapshotRequest,
    WireSamplingParams,
)
from deepinfer.sampling.params import SamplingParams as EngineSamplingParams
from deepinfer.service import ServiceContext
from deepinfer.telemetry import new_registry
from deepinfer.testing.checkpoints import make_tiny_checkpoint
from deepinfer.testing.streams import decode_locally
from services.decode.handler import DecodeHandler
from services.scheduler.kv_index import KvIndex, PrefixMatch

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300, 6, 70]  # 21 tokens: 5 blocks
FILLERS = [[(7 * i + 13 * j) % 300 + 1 for j in range(36)] for i in range(1, 3)]
GREEDY = WireSamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK_SIZE, DEVICE_BLOCKS, HOST_BLOCKS, MAX_MODEL_LEN = 4, 16, 256, 48
GATEWAY = "gw-host"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def block_bytes(tiny_dir) -> int:
    return EngineCore(EngineArgs(model=str(tiny_dir), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                                 kv_cache_bytes=16 << 20, progress=False)).kv_plan.bytes_per_block


@pytest.fixture(scope="module")
def reference(tiny_dir) -> list[int]:
    core = EngineCore(EngineArgs(model=str(tiny_dir), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                                 progress=False))
    core.add_request("r", PROMPT, EngineSamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
    return tokens


async def generate(bus, model: str, prompt: list[int], request_id: str):
    """Decode worker "dec-h" computes a prompt: (tokens, the first chunk)."""
    return await decode_locally(bus, model, "dec-h", GATEWAY, request_id, prompt, GREEDY)


async def test_an_evicted_prompt_comes_back_from_the_host_tier_and_the_router_learns_it(
        nats_server, bus, tiny_dir, tmp_path, block_bytes, reference):
    common = CommonSettings(nats_url=nats_server.url, nats_token=nats_server.token, model=str(tiny_dir),
                            model_cache_dir=tmp_path)
    settings = DecodeSettings(common=common, worker_id="dec-h", block_size=BLOCK_SIZE, internal_port=0,
                              data_plane_port=0, kv_store=False, max_model_len=MAX_MODEL_LEN,
                              kv_cache_bytes=DEVICE_BLOCKS * block_bytes,
                              kv_host_cache_bytes=HOST_BLOCKS * block_bytes)
    model = common.model_token
    batches: list[KvEventBatch] = []

    async def on_events(batch: KvEventBatch, msg) -> None:
        batches.append(batch)

    sub = await bus.subscribe(subjects.kv_events(model, "dec-h"), on_events, message_type=KvEventBatch)
    handler = DecodeHandler(ServiceContext("dec-h", settings, bus, new_registry(), NoOpTracer()))
    await handler.load()
    await handler.start()
    try:
        assert handler.runtime.engine.has_host_tier
        tokens, chunk = await generate(bus, model, PROMPT, "r1")
        assert tokens == reference
        assert chunk.cached_tokens_by_tier == {"device": 0, "host": 0, "store": 0}
        for i, filler in enumerate(FILLERS):  # evict PROMPT's blocks from the 15-block device pool
            await generate(bus, model, filler, f"f{i}")
        hashes = hash_blocks(PROMPT, BLOCK_SIZE, handler.runtime.engine.fingerprint, "")[:5]
        pool = handler.runtime.engine.core.scheduler.block_pool
        assert all(pool.get_cached_block(x) is None for x in hashes)

        tokens, chunk = await generate(bus, model, PROMPT, "r2")
        assert tokens == reference  # the loaded KV is the computed KV
        assert (chunk.num_cached_tokens, chunk.cached_tokens_by_tier) == (20, {"device": 0, "host": 20, "store": 0})
        await handler.runtime.heartbeat()  # metrics are brought up to date at each heartbeat
        registry = handler.ctx.registry
        assert registry.get_sample_value("deepinfer_worker_host_tier_loaded_blocks_total") == 5
        assert registry.get_sample_value("deepinfer_worker_host_tier_load_seconds_count") == 1
        assert registry.get_sample_value("deepinfer_worker_host_tier_used_bytes") > 0

        for _ in range(100):  # the events of the last steps are published in the background
            if batches and batches[-1].seq == handler.runtime.engine_loop.kv_events_seq:
                break
            await asyncio.sleep(0.05)
        host_stored = {bytes(x) for b in batches for e in b.events if e.tier is KvTier.HOST
                       and e.event_kind == "stored" for x in e.block_hashes}
        assert set(hashes) <= host_stored
        index = KvIndex()  # the scheduler's index, fed the worker's snapshot then its events after it
        assert index.observe_worker("dec-h", handler.runtime.layout.layout_id(), handler.runtime.epoch)
        assert index.begin_snapshot("dec-h")
        page = await bus.request(subjects.snapshot(model, "dec-h"), SnapshotRequest(page_size=4096), SnapshotPage,
                                 timeout_s=10)
        assert page.next_cursor is None and set(hashes) <= {bytes(x) for x in page.host_block_hashes}
        assert index.apply_page(page) and index.end_snapshot("dec-h")
        found = index.match(handler.runtime.layout.layout_id(), hashes, ["dec-h"])["dec-h"]
        assert found == PrefixMatch(device_blocks=5)  # back on the device, and still in the host tier
        await generate(bus, model, FILLERS[0], "f9")  # the device evicts PROMPT again: host tier only
        for _ in range(100):
            if batches[-1].seq == handler.runtime.engine_loop.kv_events_seq:
                break
            await asyncio.sleep(0.05)
        for batch in batches:
            if batch.seq > page.seq:
                index.apply_batch(batch)
        found = index.match(handler.runtime.layout.layout_id(), hashes, ["dec-h"])["dec-h"]
        assert found.num_blocks == 5 and found.lower_blocks > 0
    finally:
        await sub.unsubscribe()
        await handler.close()
