"""Which blocks a worker writes behind to the store: its requests' prompt blocks, generated ones only when asked."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from deepinfer.config import WorkerSettings
from deepinfer.hashing import hash_blocks
from deepinfer.sampling.params import SamplingParams
from deepinfer.telemetry import new_registry
from deepinfer.worker.store_tier import StoreTier

BLOCK, FINGERPRINT = 4, b"tiny-model"


class NoShardLookups:
    """A client that knows a shard (so write-behind is on) and finds nothing stored."""

    def has_shards(self) -> bool:
        return True

    async def has(self, layout_id, hashes, connection="read"):
        return [False] * len(hashes)


class AddOnly:
    """The engine loop as StoreTier's admission uses it: `call(fn)` runs `fn(core)`."""

    core = SimpleNamespace(args=SimpleNamespace(block_size=BLOCK), fingerprint=FINGERPRINT, host_tier=None,
                           add_request=lambda *args, **kwargs: None,
                           scheduler=SimpleNamespace(block_pool=SimpleNamespace(get_cached_block=lambda h: None)))

    async def call(self, fn):
        return fn(self.core)


def tier(**settings) -> StoreTier:
    return StoreTier(WorkerSettings(**settings), new_registry(process_metrics=False), AddOnly(), "layout",
                     NoShardLookups())


def test_only_prompt_blocks_are_written_behind_by_default():
    prompt, generated = list(range(1, 10)), [11, 12, 13, 14, 15, 16, 17, 18]
    hashes = hash_blocks(prompt + generated, BLOCK, FINGERPRINT, "")
    for settings, expected in (({}, hashes[:2]), ({"kv_store_write_generated": True}, hashes)):
        store = tier(**settings)
        asyncio.run(store.add_request("r", prompt, SamplingParams(max_tokens=8)))
        store.on_stored(hashes)  # the prompt's two full blocks, then two of generated tokens
        assert list(store._queue) == expected


def test_with_the_host_tier_blocks_are_written_once_its_slots_hold_them():
    from deepinfer.engine.block_pool import Stored

    hashes = hash_blocks(list(range(1, 17)), BLOCK, FINGERPRINT, "")
    events = [Stored(hashes[:2], None), Stored(hashes[2:], None, tier="host")]
    store = tier(kv_store_write_generated=True)
    store.on_kv_events(events)
    assert list(store._queue) == hashes[:2]  # no host tier: the device's cache events
    store = tier(kv_store_write_generated=True)
    store.engine = AddOnly()
    store.engine.core = SimpleNamespace(**{**vars(AddOnly.core), "host_tier": object()})
    store.on_kv_events(events)
    assert list(store._queue) == hashes[2:]  # host tier on: its slots are what write-behind reads
