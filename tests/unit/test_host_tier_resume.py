"""A preempted request resumes from the host tier (engine/host_tier.py, forced on on the CPU by kv_host_cache_bytes),
step by step on a tiny model with a small device pool:

    c (4 tokens, 14 out), d (12 tokens, 10 out), b (P: 19 tokens, 3 out), all admitted in step 1.
    step 3: b needs a 6th block, the pool is empty: b (the newest) preempts itself. It computed 20 tokens (its
            prompt and first output token): 5 full blocks, cached and written through to the host tier.
    c and d grow into b's freed blocks (b's tail first): only b's first block is left on the device.
    d finishes: b, at the head of the queue, looks up the tiers as admission does: 1 device block, then 4 in
            the host tier → loading (c runs meanwhile) → b runs from token 20 (it holds 21): 1 token computed.

Its tokens equal those of an engine whose pool never preempts; without the host tier (or when the load fails) the
same resume recomputes its 16 tokens past the device block."""

from __future__ import annotations

import pytest

from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import EngineCore
from deepinfer.engine.request import RequestStatus
from deepinfer.sampling.params import SamplingParams

P = [5, 17, 42, 99, 7, 250, 31, 64, 12, 8, 77, 150, 23, 4, 200, 180, 9, 11, 300]
C = [8, 21, 34, 47]
D = [15, 28, 41, 54, 67, 80, 93, 106, 119, 132, 145, 158]
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
REQUESTS = (("c", C, 14), ("d", D, 10), ("b", P, 3))
BLOCK_SIZE, DEVICE_BLOCKS, HOST_BLOCKS = 4, 12, 64  # 11 usable device blocks (block 0 is the null block)

#: Steps 4-10: c and d decode while b waits (preempted); d's last step is 10.
WAITING = [{"c": (c, 1, False), "d": (c + 8, 1, False)} for c in range(6, 13)]
#: Steps 1-10, the same in every run below: (scheduled, preempted, loading) per step.
UNTIL_D_ENDS = [
    ({"c": (0, 4, True), "d": (0, 12, True), "b": (0, 19, True)}, [], []),
    ({"c": (4, 1, False), "d": (12, 1, False), "b": (19, 1, False)}, [], []),
    ({"c": (5, 1, False), "d": (13, 1, False)}, ["b"], []),
    *[(step, [], []) for step in WAITING],
]


def c_alone(*num_computed: int) -> list:
    return [({"c": (n, 1, False)}, [], []) for n in num_computed]


def engine(tiny_dir, kv_cache_bytes: int, kv_host_cache_bytes: int, async_scheduling: bool) -> EngineCore:
    return EngineCore(EngineArgs(model=str(tiny_dir), block_size=BLOCK_SIZE, progress=False, max_model_len=32,
                                 kv_cache_bytes=kv_cache_bytes, kv_host_cache_bytes=kv_host_cache_bytes,
                                 async_scheduling=async_scheduling,
                                 prefill_chunk_s=0))  # the steps asserted here are the token budget's, not timed


def record(core: EngineCore) -> list[tuple[dict[str, tuple[int, int, bool]], list[str], list[str]]]:
    """Each step's (num_computed_tokens, num_new_tokens, is_new) per request, the requests it preempted and those
    loading once it was scheduled."""
    steps: list = []
    scheduler = core.scheduler
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        scheduled = {s.request_id: (s.num_computed_tokens, s.num_new_tokens, s.is_new) for s in out.scheduled}
        steps.append((scheduled, list(out.preempted_request_ids), list(scheduler.loading)))
        return out

    scheduler.schedule = recording
    return steps


def run(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, tuple[int, int]]]:
    """Every request's tokens, and the (cached, host-cached) tokens of its last output."""
    for request_id, prompt, max_tokens in REQUESTS:
        core.add_request(request_id, prompt, GREEDY.clone(max_tokens=max_tokens))
    tokens: dict[str, list[int]] = {}
    usage: dict[str, tuple[int, int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            usage[out.request_id] = (out.num_cached_tokens, out.num_host_cached_tokens)
    return tokens, usage


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict[str, list[int]]:
    """Tokens of an engine that never preempts (a large pool, no host tier)."""
    core = engine(tiny_dir, 16 << 20, 0, async_scheduling=False)
    steps = record(core)
    tokens, _ = run(core)
    assert not any(preempted for _, preempted, _ in steps)
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_preempted_request_resumes_from_the_host_tier_while_another_runs(
        tiny_dir, block_bytes, reference, async_scheduling):
    from prometheus_client import CollectorRegistry

    from deepinfer.worker.host_tier_metrics import HostTierMetrics

    core = engine(tiny_dir, DEVICE_BLOCKS * block_bytes, HOST_BLOCKS * block_bytes, async_scheduling)
    registry = CollectorRegistry()
    metrics = HostTierMetrics(registry, core.host_tier.capacity_bytes)
    steps = record(core)
    tokens, usage = run(core)

    # Async scheduling learns that d finished one step later (update(N) runs after schedule(N+1)), and drains
    # the step in flight at the end.
    late = c_alone(13) if async_scheduling else []
    assert steps == [
        *UNTIL_D_ENDS,
        *late,
        ({"c": (13 + len(late), 1, False)}, [], ["b"]),  # b's blocks load while c decodes
        ({"c": (14 + len(late), 1, False), "b": (20, 1, True)}, [], []),  # only its token past the 20 loaded
        *c_alone(*range(15 + len(late), 17)),
        *([({}, [], [])] if async_scheduling else []),
    ]
    assert tokens == reference
    stats = core.host_tier.stats
    # b's 4 blocks past its device block (the last holds its first output token), loaded; its admission (and
    # c's, d's) found nothing in the host tier: the 6 misses are theirs (d: 2 blocks, b: 4).
    assert (stats.hit_blocks, stats.loaded_blocks, stats.failed_loads, stats.miss_blocks) == (4, 4, 0, 6)
    metrics.update(core.host_tier.report())  # what the worker exports
    assert registry.get_sample_value("deepinfer_worker_host_tier_hit_blocks_total") == 4
    assert registry.get_sample_value("deepinfer_worker_host_tier_loaded_blocks_total") == 4
    assert registry.get_sample_value("deepinfer_worker_host_tier_load_seconds_count") == 1
    # The client's usage stays that of b's admission: nothing was cached then.
    assert usage["b"] == (0, 0)
    assert not core.host_tier.busy and not core.scheduler.loading
    assert core.scheduler.block_pool.num_free_blocks == DEVICE_BLOCKS - 1  # no reference left behind


def recomputed_resume(async_scheduling: bool) -> list:
    """Steps 11 on when b's resume recomputes its tokens past its one device block (16 of its 21 tokens)."""
    late = c_alone(13) if async_scheduling else []
    return [
        *late,
        ({"c": (13 + len(late), 1, False), "b": (4, 17, True)}, [], []),
        *c_alone(*range(14 + len(late), 17)),
        *([({}, [], [])] if async_scheduling else []),
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_without_the_host_tier_the_resume_recomputes(tiny_dir, block_bytes, reference, async_scheduling):
    core = engine(tiny_dir, DEVICE_BLOCKS * block_bytes, 0, async_scheduling)
    assert core.host_tier is None and core.scheduler.resume_loader is None
    steps = record(core)
    tokens, _ = run(core)
    assert steps == [*UNTIL_D_ENDS, *recomputed_resume(async_scheduling)]
    assert tokens == reference


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_resume_whose_load_fails_recomputes_in_the_same_step(
        tiny_dir, block_bytes, reference, monkeypatch, async_scheduling):
    core = engine(tiny_dir, DEVICE_BLOCKS * block_bytes, HOST_BLOCKS * block_bytes, async_scheduling)
    seen: list[RequestStatus] = []

    def broken(slots, block_ids, started=None):
        seen.append(core.scheduler.requests["b"].status)
        raise RuntimeError("copy engine fault")

    monkeypatch.setattr(core.host_tier, "copy_to_device", broken)
    steps = record(core)
    tokens, usage = run(core)
    assert seen == [RequestStatus.WAITING_FOR_REMOTE_KVS]  # offered once; back in the queue, admitted as usual
    assert steps == [*UNTIL_D_ENDS, *recomputed_resume(async_scheduling)]
    assert tokens == reference and usage["b"] == (0, 0)
    stats = core.host_tier.stats
    assert (stats.hit_blocks, stats.loaded_blocks, stats.failed_loads) == (4, 0, 1)
    assert core.scheduler.block_pool.num_free_blocks == DEVICE_BLOCKS - 1
