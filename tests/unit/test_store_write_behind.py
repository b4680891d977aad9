"""Which blocks a worker writes behind to the store: its requests' prompt blocks, generated ones only when asked."""

from __future__ import annotations

import asyncio

from deepinfer.config import WorkerSettings
from deepinfer.engine import EngineRequest
from deepinfer.hashing import hash_blocks
from deepinfer.sampling.params import SamplingParams
from deepinfer.telemetry import new_registry
from deepinfer.testing.fake_engine import AdmissionRecorder
from deepinfer.worker.store_tier import StoreTier

BLOCK, FINGERPRINT = 4, b"tiny-model"


class NoShardLookups:
    """A client that knows a shard (so write-behind is on) and finds nothing stored."""

    def has_shards(self) -> bool:
        return True

    def all_shared_memory(self) -> bool:
        return False

    async def has(self, layout_id, hashes, connection="read"):
        return [False] * len(hashes)


def tier(has_host_tier: bool = False, **settings) -> StoreTier:
    engine = AdmissionRecorder(BLOCK, FINGERPRINT, has_host_tier)
    return StoreTier(WorkerSettings(**settings), new_registry(process_metrics=False), engine, engine,
                     NoShardLookups())


def test_only_prompt_blocks_are_written_behind_by_default():
    prompt, generated = list(range(1, 10)), [11, 12, 13, 14, 15, 16, 17, 18]
    hashes = hash_blocks(prompt + generated, BLOCK, FINGERPRINT, "")
    for settings, expected in (({}, hashes[:2]), ({"kv_store_write_generated": True}, hashes)):
        store = tier(**settings)
        asyncio.run(store.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=8))))
        store.on_stored(hashes)  # the prompt's two full blocks, then two of generated tokens
        assert list(store._queue) == expected


def test_with_the_host_tier_blocks_are_written_once_its_slots_hold_them():
    from deepinfer.engine.block_pool import Stored

    hashes = hash_blocks(list(range(1, 17)), BLOCK, FINGERPRINT, "")
    events = [Stored(hashes[:2], None), Stored(hashes[2:], None, tier="host")]
    store = tier(kv_store_write_generated=True)
    store.on_kv_events(events)
    assert list(store._queue) == hashes[:2]  # no host tier: the device's cache events
    store = tier(has_host_tier=True, kv_store_write_generated=True)
    store.on_kv_events(events)
    assert list(store._queue) == hashes[2:]  # host tier on: its slots are what write-behind reads
