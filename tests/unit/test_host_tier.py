"""The host-memory KV tier on the CPU (engine/host_tier.py, forced on by kv_host_cache_bytes), on a tiny model with
a small device pool: a prompt evicted from the device comes back from the host tier through the loading state
while another request keeps decoding, runs only its tokens past the loaded prefix, and gives the tokens of an
engine without tiers; a slot holds the block in export_blocks' payload format; a failed load recomputes."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.engine.kv_transfer import export_blocks
from deepinfer.engine.request import RequestStatus
from deepinfer.hashing import hash_blocks
from deepinfer.kv_costs import HOST
from deepinfer.kv_rates import Throughput
from deepinfer.sampling.params import SamplingParams

P = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300]  # 19 tokens: 4 full blocks to hit
FILLERS = [[(7 * i + 13 * j) % 300 + 1 for j in range(28)] for i in range(1, 3)]  # 28 tokens each
OTHER = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BLOCK_SIZE, DEVICE_BLOCKS, HOST_BLOCKS = 4, 12, 64


def engine_args(tiny_dir, block_bytes: int, host_blocks: int = HOST_BLOCKS, **kw) -> EngineArgs:
    return EngineArgs(model=str(tiny_dir), block_size=BLOCK_SIZE, progress=False, max_model_len=32,
                      kv_cache_bytes=DEVICE_BLOCKS * block_bytes, kv_host_cache_bytes=host_blocks * block_bytes, **kw)


def engine(tiny_dir, block_bytes: int, host_blocks: int = HOST_BLOCKS, **kw) -> EngineCore:
    return EngineCore(engine_args(tiny_dir, block_bytes, host_blocks, **kw))


def run(core: EngineCore, tokens: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    tokens = {} if tokens is None else tokens
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def record_schedules(core: EngineCore) -> list[dict[str, tuple[int, int, bool]]]:
    """Each step's (num_computed_tokens, num_new_tokens, is_new) per request, as the scheduler decided it."""
    steps: list[dict[str, tuple[int, int, bool]]] = []
    schedule = core.scheduler.schedule

    def recording():
        out = schedule()
        steps.append({s.request_id: (s.num_computed_tokens, s.num_new_tokens, s.is_new) for s in out.scheduled})
        return out

    core.scheduler.schedule = recording
    return steps


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict[str, list[int]]:
    """Tokens of an engine without tiers (host tier off, a pool large enough to never evict)."""
    core = EngineCore(EngineArgs(model=str(tiny_dir), block_size=BLOCK_SIZE, progress=False, max_model_len=32,
                                 kv_cache_bytes=16 << 20, kv_host_cache_bytes=0))
    assert core.host_tier is None
    core.add_request("p", P, GREEDY)
    core.add_request("o", OTHER, GREEDY.clone(max_tokens=12))
    return run(core)


def evict_p(core: EngineCore) -> list[bytes]:
    """Compute P, then fillers until none of P's blocks is left on the device; P's prompt block hashes."""
    hashes = hash_blocks(P, BLOCK_SIZE, core.fingerprint, "")
    core.add_request("p0", P, GREEDY)
    run(core)
    assert core.host_tier.pool.num_leading_hits(hashes) == 4  # written through at cache time
    for i, filler in enumerate(FILLERS):
        core.add_request(f"f{i}", filler, GREEDY)
        run(core)
    pool = core.scheduler.block_pool
    assert all(pool.get_cached_block(x) is None for x in hashes)
    return hashes


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_evicted_prompt_loads_from_the_host_tier_while_another_request_decodes(
        tiny_dir, block_bytes, reference, async_scheduling):
    core = engine(tiny_dir, block_bytes, async_scheduling=async_scheduling)
    evict_p(core)
    core.add_request("o", OTHER, GREEDY.clone(max_tokens=12))
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    steps = record_schedules(core)

    core.add_request("p", P, GREEDY)
    p = core.scheduler.requests["p"]
    assert p.status is RequestStatus.WAITING_FOR_REMOTE_KVS and "p" in core.scheduler.loading
    assert core.host_tier.busy
    outputs = core.step()  # the copy (synchronous on the CPU) is finished at the start of the step
    # o decodes on (8 prompt tokens, 2 generated, the third computed now); p joins with only its last 3 prompt
    # tokens computed: its first 16 were loaded.
    assert steps == [{"o": (10, 1, False), "p": (16, 3, True)}]
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.request_id == "p":
            assert (out.num_cached_tokens, out.num_host_cached_tokens, out.num_store_cached_tokens) == (16, 16, 0)
    run(core, tokens)
    assert tokens["p"] == reference["p"] and tokens["o"] == reference["o"]
    stats = core.host_tier.stats
    assert (stats.hit_blocks, stats.loaded_blocks, stats.failed_loads) == (4, 4, 0)
    assert not core.host_tier.busy
    assert core.scheduler.block_pool.num_free_blocks == DEVICE_BLOCKS - 1  # no reference left behind
    assert core.rates.decisions[HOST, "loaded"] == 16 and core.rates.loads[HOST].num_samples == 1
    assert core.rates.prefill.num_samples > 0  # the prompt steps (P: 19 tokens, over two blocks)


def test_a_host_tier_slower_than_computing_is_not_loaded_from(tiny_dir, block_bytes, reference):
    core = engine(tiny_dir, block_bytes)
    evict_p(core)
    core.rates.prefill = Throughput(1e12)  # computing a block takes no time: no load is worth it
    core.add_request("p", P, GREEDY)
    assert core.scheduler.requests["p"].status is RequestStatus.WAITING and not core.host_tier.busy
    first = core.step()[0]
    assert (first.num_cached_tokens, first.num_host_cached_tokens) == (0, 0)
    assert first.new_token_ids + run(core)["p"] == reference["p"]
    assert core.rates.decisions == {(HOST, "recomputed"): 16}
    assert core.host_tier.stats.loaded_blocks == 0


def test_a_host_slot_holds_the_block_in_the_store_payload_format(tiny_dir, block_bytes):
    core = engine(tiny_dir, block_bytes, enable_kv_events=True)
    core.add_request("p", P, GREEDY)
    run(core)
    hashes = hash_blocks(P, BLOCK_SIZE, core.fingerprint, "")[:4]
    device_ids = [core.scheduler.block_pool.get_cached_block(x).block_id for x in hashes]
    assert core.host_tier.payloads(hashes) == export_blocks(core.runner.kv_caches, device_ids)
    events = core.take_kv_events()
    host_stored = [x for e in events if getattr(e, "tier", "") == "host" for x in e.block_hashes]
    assert set(hashes) <= set(host_stored)


def test_a_load_that_fails_recomputes(tiny_dir, block_bytes, reference, monkeypatch):
    core = engine(tiny_dir, block_bytes)
    evict_p(core)

    def broken(slots, block_ids, started=None):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(core.host_tier, "copy_to_device", broken)
    core.add_request("p", P, GREEDY)
    assert core.scheduler.requests["p"].status is RequestStatus.WAITING  # back in the queue: recomputed
    first = core.step()[0]
    assert (first.num_cached_tokens, first.num_host_cached_tokens) == (0, 0)
    assert first.new_token_ids + run(core)["p"] == reference["p"]
    assert core.host_tier.stats.failed_loads == 1
    assert core.scheduler.block_pool.num_free_blocks == DEVICE_BLOCKS - 1


def test_a_small_host_pool_evicts_and_the_tier_is_off_by_default_on_the_cpu(tiny_dir, block_bytes):
    core = engine(tiny_dir, block_bytes, host_blocks=3)
    core.add_request("p", P, GREEDY)
    run(core)
    pool = core.host_tier.pool
    assert pool.num_used == 3 and pool.num_evictions > 0
    off = EngineCore(EngineArgs(model=str(tiny_dir), block_size=BLOCK_SIZE, progress=False, max_model_len=32,
                                kv_cache_bytes=16 << 20))
    assert off.host_tier is None and not off.scheduler.block_pool.track_cached


def test_a_store_load_takes_the_host_held_blocks_from_the_host_tier(tiny_dir, block_bytes, reference):
    from deepinfer.engine import Engine, EngineRequest, StoredKv
    from deepinfer.engine.kv_load import export_cached, finish_load

    other = engine(tiny_dir, block_bytes, host_blocks=0)  # what another worker wrote to the store
    other.add_request("p", P, GREEDY)
    run(other)
    hashes = hash_blocks(P, BLOCK_SIZE, other.fingerprint, "")[:4]
    kept, stored = export_cached(other, hashes)
    assert kept == hashes
    front = Engine(engine_args(tiny_dir, block_bytes))
    core = front.core
    core.add_request("half", P[:9], GREEDY.clone(max_tokens=1))  # P's first 2 blocks: device, then host
    run(core)
    for i, filler in enumerate(FILLERS):
        core.add_request(f"f{i}", filler, GREEDY)
        run(core)
    assert core.scheduler.block_pool.get_cached_block(hashes[0]) is None

    admission = front.add_request(EngineRequest("p", P, GREEDY, kv=StoredKv(4, hashes)))
    plan, local = admission.load, admission.local_payloads
    assert admission.kv == "loading"
    assert (plan.first_block, len(plan.block_ids)) == (0, 4)
    assert local[2:] == [None, None]  # the store is asked only for blocks 2 and 3
    for held, computed in zip(local[:2], stored[:2], strict=True):  # the same KV (computed in another batch shape)
        assert np.allclose(np.frombuffer(held, np.float32), np.frombuffer(computed, np.float32), atol=1e-5)
    assert finish_load(core, plan, [*local[:2], *stored[2:]], num_host_blocks=2)
    request = core.scheduler.requests["p"]
    assert (request.num_host_cached_tokens, request.num_store_cached_tokens) == (8, 8)  # 2 blocks of 4 each
    assert run(core)["p"] == reference["p"]


def test_write_behind_exports_blocks_evicted_from_the_device_from_their_host_slots(tiny_dir, block_bytes):
    from deepinfer.engine.kv_load import export_cached

    core = engine(tiny_dir, block_bytes)
    core.add_request("p", P, GREEDY)
    run(core)
    hashes = hash_blocks(P, BLOCK_SIZE, core.fingerprint, "")[:4]
    kept, on_device = export_cached(core, hashes)  # device and host both hold them: the host slots are read
    assert kept == hashes
    ids = [core.scheduler.block_pool.get_cached_block(h).block_id for h in hashes]
    assert on_device == export_blocks(core.runner.kv_caches, ids)
    for i, filler in enumerate(FILLERS):
        core.add_request(f"f{i}", filler, GREEDY)
        run(core)
    assert all(core.scheduler.block_pool.get_cached_block(h) is None for h in hashes)  # gone from the device
    assert export_cached(core, hashes) == (hashes, on_device)  # still written behind, from the host tier


def test_the_worker_metrics_report_host_tier_hit_ages(tiny_dir, block_bytes):
    from prometheus_client import CollectorRegistry

    from deepinfer.worker.host_tier_metrics import HostTierMetrics

    core = engine(tiny_dir, block_bytes)
    registry = CollectorRegistry()
    metrics = HostTierMetrics(registry, core.host_tier.capacity_bytes)
    evict_p(core)
    core.add_request("p", P, GREEDY)
    run(core)
    metrics.update(core.host_tier.report())
    assert registry.get_sample_value("deepinfer_worker_host_tier_hit_age_seconds_count") == 4  # P's 4 blocks
    assert registry.get_sample_value("deepinfer_worker_host_tier_loaded_blocks_total") == 4
    assert registry.get_sample_value("deepinfer_worker_host_tier_offload_seconds_count") > 0
    assert not core.host_tier.pool.hit_ages  # taken by the metrics


def test_offloads_wait_for_a_batch_or_an_age_or_the_engine_going_idle(tiny_dir, block_bytes):
    """(CUDA's batching, set on the CPU): blocks cached by a step wait until 8 are pending, 3 steps have passed,
    or nothing is left to run; then one copy takes them all."""
    core = engine(tiny_dir, block_bytes)
    tier = core.host_tier
    tier.offload_batch_blocks, tier.offload_max_steps = 8, 3
    core.add_request("o", OTHER, GREEDY.clone(max_tokens=12))  # 8 tokens: 2 blocks cached by the first step
    offloaded = []
    for _ in range(4):
        core.step()
        offloaded.append(tier.stats.offloaded_blocks)
    assert offloaded[:2] == [0, 0]  # pending: 2 blocks, under the batch
    assert offloaded[2] >= 2  # three steps old: copied
    core.add_request("p", P, GREEDY)  # 4 full blocks in its first step
    run(core)  # the last step, with nothing left to run, flushes what waits
    assert tier.stats.offloaded_blocks >= 2 + 4 and not tier._pending


def test_close_lets_the_host_pool_go_now(tiny_dir, block_bytes):
    """EngineCore.close (LLM.close, `with LLM(...)`) frees the host tier's pool without waiting for the engine to be
    collected: on a GPU it is pinned memory, and a process that builds several engines runs out of it."""
    import gc
    import weakref

    core = engine(tiny_dir, block_bytes)
    core.add_request("p0", P, GREEDY)
    run(core)
    pool = weakref.ref(core.host_tier.host)
    gc.disable()  # only the references close drops may free it, not a collection of the engine's cycles
    try:
        core.close()
        assert core.host_tier is None and pool() is None
    finally:
        gc.enable()
