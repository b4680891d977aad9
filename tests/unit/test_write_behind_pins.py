"""Write-behind's payloads (engine/kv_load.pin_cached) on a tiny model on the CPU: with the host tier, read-only
views of pinned host slots (no copy, no device export; a slot stays put until released and the engine's next step),
and only blocks the host tier holds; without it, the device export."""

from __future__ import annotations

from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.engine.kv_load import export_cached, pin_cached
from deepinfer.engine.kv_transfer import export_blocks
from deepinfer.hashing import hash_blocks
from deepinfer.sampling.params import SamplingParams

P = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300]  # 19 tokens: 4 full blocks
FILLERS = [[(7 * i + 13 * j) % 300 + 1 for j in range(28)] for i in range(1, 4)]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BLOCK_SIZE, DEVICE_BLOCKS = 4, 12


def engine(tiny_dir, block_bytes: int, host_blocks: int) -> EngineCore:
    return EngineCore(EngineArgs(model=str(tiny_dir), block_size=BLOCK_SIZE, progress=False, max_model_len=32,
                                 kv_cache_bytes=DEVICE_BLOCKS * block_bytes,
                                 kv_host_cache_bytes=host_blocks * block_bytes))


def run(core: EngineCore, request_id: str, prompt: list[int]) -> None:
    core.add_request(request_id, prompt, GREEDY)
    while core.has_unfinished_requests():
        core.step()


def test_host_held_blocks_are_handed_out_as_pinned_read_only_views(tiny_dir, block_bytes):
    core = engine(tiny_dir, block_bytes, host_blocks=6)
    run(core, "p", P)
    hashes = hash_blocks(P, BLOCK_SIZE, core.fingerprint, "")[:4]
    expected = export_blocks(core.runner.kv_caches, [core.scheduler.block_pool.get_cached_block(x).block_id
                                                      for x in hashes])
    cached = pin_cached(core, hashes)
    assert cached.block_hashes == hashes and [bytes(p) for p in cached.payloads] == expected
    assert all(isinstance(p, memoryview) and p.readonly for p in cached.payloads)  # views of the slots: no copy
    pool = core.host_tier.pool
    assert all(pool.is_pinned(slot) for slot in cached.slots)
    for i, filler in enumerate(FILLERS):  # 21 more blocks through a 6-slot host tier: all but the pinned evicted
        run(core, f"f{i}", filler)
    assert [pool.lookup(x) for x in hashes] == cached.slots  # pinned: neither evicted nor rewritten
    assert [bytes(p) for p in cached.payloads] == expected
    slots = cached.slots
    cached.release()  # e.g. from the event loop: unpinned by the engine thread, not here
    assert all(pool.is_pinned(slot) for slot in slots)
    run(core, "f9", FILLERS[0])  # the next step unpins; the offloads after it may evict them again
    assert not any(pool.is_pinned(slot) for slot in slots)
    assert pool.num_leading_hits(hashes) < 4


def test_with_the_host_tier_only_its_blocks_are_written_never_a_device_export(tiny_dir, block_bytes, monkeypatch):
    core = engine(tiny_dir, block_bytes, host_blocks=2)  # P and its answer: only the last 2 blocks stay there
    run(core, "p", P)
    hashes = hash_blocks(P, BLOCK_SIZE, core.fingerprint, "")[:4]
    assert all(core.scheduler.block_pool.get_cached_block(x) is not None for x in hashes)  # all on the device

    def no_export(*args, **kwargs):
        raise AssertionError("a device export on the engine thread")

    monkeypatch.setattr("deepinfer.engine.kv_load.export_blocks", no_export)
    held = [x for x in hashes if core.host_tier.pool.lookup(x) is not None]
    cached = pin_cached(core, hashes)
    assert cached.block_hashes == held and 0 < len(held) < 4  # the others are left out (dropped: "evicted")
    cached.release()


def test_without_the_host_tier_blocks_are_exported_from_the_device(tiny_dir, block_bytes):
    core = engine(tiny_dir, block_bytes, host_blocks=0)
    run(core, "p", P)
    hashes = hash_blocks(P, BLOCK_SIZE, core.fingerprint, "")[:4]
    cached = pin_cached(core, hashes)
    assert (cached.block_hashes, cached.payloads) == export_cached(core, hashes) and cached.slots == []
    cached.release()
