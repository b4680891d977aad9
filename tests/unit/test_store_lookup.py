"""Admission lookups in the kvcache store, coalesced (`StoreLookups`): requests that arrive together share one
`has`, each gets the leading run of its own blocks, and a failed lookup is a miss for all of them."""

from __future__ import annotations

import asyncio

from deepinfer.config import WorkerSettings
from deepinfer.engine import ComputeKv, EngineRequest, StoredKv
from deepinfer.hashing import hash_blocks
from deepinfer.kv_costs import HOST, STORE
from deepinfer.kv_rates import Throughput
from deepinfer.sampling.params import SamplingParams
from deepinfer.telemetry import counter, new_registry
from deepinfer.testing.fake_engine import AdmissionRecorder
from deepinfer.worker.store_lookup import StoreLookups
from deepinfer.worker.store_tier import StoreTier

BLOCK, FINGERPRINT = 4, b"tiny-model"


class Store:
    """A client over a set of held hashes: records every `has` (the blocks asked), answers after `delay_s`, or
    raises `error`."""

    def __init__(self, held=(), delay_s: float = 0.0, error: Exception | None = None) -> None:
        self.held, self.delay_s, self.error = set(held), delay_s, error
        self.asked: list[list[bytes]] = []
        self.connections: list[str] = []

    def has_shards(self) -> bool:
        return True

    def all_shared_memory(self) -> bool:
        return False

    async def has(self, layout_id, hashes, connection="read"):
        self.asked.append(list(hashes))
        self.connections.append(connection)
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return [h in self.held for h in hashes]


def lookups(store: Store, timeout_s: float = 1.0) -> tuple[StoreLookups, object]:
    registry = new_registry(process_metrics=False)
    results = counter(registry, "worker_store_lookups", "by result", ["result"])
    trips = counter(registry, "worker_store_lookup_round_trips", "sent")
    return StoreLookups(store, "layout", timeout_s, results, trips), registry


def count(registry, name: str, **labels) -> float:
    return registry.get_sample_value(f"deepinfer_{name}_total", labels) or 0.0


def blocks(seed: int, n: int) -> list[bytes]:
    return hash_blocks([seed * 100 + k for k in range(n * BLOCK)], BLOCK, FINGERPRINT, "")


def test_a_burst_with_hits_and_misses_is_one_round_trip_and_each_request_gets_its_own_leading_run():
    shared, hit, miss, partial = blocks(1, 2), blocks(2, 3), blocks(3, 2), blocks(4, 3)
    store = Store(held=[*shared, *hit, partial[0], partial[2]])  # partial: a hole at its second block
    finder, registry = lookups(store)

    async def burst():
        return await asyncio.gather(*(finder.leading(h) for h in (shared, hit, miss, partial, shared)))

    assert asyncio.run(burst()) == [2, 3, 0, 1, 2]
    assert len(store.asked) == 1
    assert store.asked[0] == list(dict.fromkeys([*shared, *hit, *miss, *partial]))  # each block asked once
    assert store.connections == ["lookup"]  # its own connection: never behind a load's get
    assert count(registry, "worker_store_lookup_round_trips") == 1
    assert (count(registry, "worker_store_lookups", result="hit"),
            count(registry, "worker_store_lookups", result="miss")) == (4, 1)


def test_requests_arriving_during_a_lookup_go_together_in_the_next():
    store = Store(held=blocks(1, 2), delay_s=0.02)
    finder, registry = lookups(store)

    async def waves():
        first = asyncio.create_task(finder.leading(blocks(1, 2)))
        await asyncio.sleep(0.005)  # the first lookup is in flight
        later = await asyncio.gather(*(finder.leading(blocks(seed, 2)) for seed in (1, 5, 6)))
        return await first, later

    assert asyncio.run(waves()) == (2, [2, 0, 0])
    assert [len(asked) for asked in store.asked] == [2, 6]
    assert count(registry, "worker_store_lookup_round_trips") == 2


def test_a_failed_or_late_lookup_is_a_miss_for_every_request_in_it_never_an_error():
    for store, timeout_s in ((Store(error=ConnectionResetError("shard gone")), 1.0),
                             (Store(held=blocks(1, 2), delay_s=0.5), 0.02)):
        finder, registry = lookups(store, timeout_s)

        async def burst(finder=finder):
            return await asyncio.gather(*(finder.leading(blocks(seed, 2)) for seed in (1, 2, 3)))

        assert asyncio.run(burst()) == [0, 0, 0]
        assert count(registry, "worker_store_lookups", result="error") == 3
        assert count(registry, "worker_store_lookups", result="miss") == 0


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a controlled clock: `time()` only moves when nothing is ready to run, and then jumps to
    the next timer. Timeouts and sleeps take no wall time, and what a test reads from `loop.time()` is exactly
    what the code scheduled, however loaded the machine (no I/O here: nothing else wakes the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def _run_once(self) -> None:
        if not self._ready and self._scheduled:
            self._now = max(self._now, self._scheduled[0].when())
        super()._run_once()


def test_a_request_arriving_during_a_stalled_lookup_waits_the_timeout_in_all_not_twice():
    store = Store(held=blocks(1, 2), delay_s=10)
    finder, registry = lookups(store, timeout_s=1.0)

    async def behind_a_stalled_lookup():
        loop = asyncio.get_running_loop()
        first = asyncio.create_task(finder.leading(blocks(1, 2)))
        await asyncio.sleep(0.02)  # the first lookup is in flight, and stalls
        started_s = loop.time()
        second = await finder.leading(blocks(1, 2))
        return await first, second, loop.time() - started_s

    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        first, second, waited_s = runner.run(behind_a_stalled_lookup())
    assert (first, second) == (0, 0)
    assert len(store.asked) == 2  # the second went in a lookup of its own, after the first's ended
    # on the controlled clock: its timeout (1 s) from its arrival, i.e. the first's remaining 0.98 s and then
    # what is left of its own (0.02 s), not 1 s more (1.98 s); the store's 10 s never elapse
    assert abs(waited_s - 1.0) < 1e-6
    assert count(registry, "worker_store_lookups", result="error") == 2  # both answered by the timeout


def test_close_answers_waiting_requests_with_misses():
    store = Store(held=blocks(1, 2), delay_s=10)
    finder, _ = lookups(store)

    async def closed_mid_lookup():
        waiting = asyncio.gather(*(finder.leading(blocks(seed, 2)) for seed in (1, 2)))
        await asyncio.sleep(0.01)
        await finder.close()
        return await asyncio.wait_for(waiting, 1), await finder.leading(blocks(1, 2))

    assert asyncio.run(closed_mid_lookup()) == ([0, 0], 0)


def test_a_burst_of_admissions_with_a_failing_store_computes_every_prompt():
    engine, store = AdmissionRecorder(BLOCK, FINGERPRINT), Store(error=TimeoutError())
    tier = StoreTier(WorkerSettings(kv_store_min_lookup_tokens=0), new_registry(process_metrics=False), engine,
                     engine, store)
    prompts = {f"r{i}": [i * 50 + k for k in range(3 * BLOCK + 1)] for i in range(8)}

    async def burst():
        await asyncio.gather(*(tier.add_request(EngineRequest(r, p, SamplingParams(max_tokens=4)))
                               for r, p in prompts.items()))

    asyncio.run(burst())
    assert sorted(engine.added) == sorted(prompts)  # all queued to compute, none refused
    assert len(store.asked) == 1 and len(store.asked[0]) == 8 * 3


def test_a_rest_shorter_than_the_lookup_minimum_is_queued_without_asking_the_store():
    prompt = list(range(3 * BLOCK + 1))  # 3 full blocks, none held here
    for minimum, asked in ((3 * BLOCK + 1, False), (3 * BLOCK, True)):
        engine, store = AdmissionRecorder(BLOCK, FINGERPRINT), Store()
        registry = new_registry(process_metrics=False)
        tier = StoreTier(WorkerSettings(kv_store_min_lookup_tokens=minimum), registry, engine, engine, store)
        asyncio.run(tier.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=4))))
        assert engine.added == ["r"]
        assert (len(store.asked), count(registry, "worker_store_lookups", result="skipped")) == (
            (1, 0) if asked else (0, 1))


# -- load or recompute at admission (deepinfer.kv_costs at the engine's measured rates) -----------------------------

def admit(engine: AdmissionRecorder, store: Store, prompt: list[int]) -> object:
    registry = new_registry(process_metrics=False)
    tier = StoreTier(WorkerSettings(kv_store_min_lookup_tokens=0), registry, engine, engine, store)
    asyncio.run(tier.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=4))))
    return registry


def test_a_store_slower_than_this_worker_computes_is_not_asked():
    prompt = list(range(3 * BLOCK + 1))
    store = Store(held=hash_blocks(prompt, BLOCK, FINGERPRINT, "")[:3])
    engine = AdmissionRecorder(BLOCK, FINGERPRINT, kv_bytes_per_block=1 << 20)
    engine.rates.prefill = Throughput(4e6)  # a 4-token block in 1 µs; 1 MiB from the store at 1.5 GB/s: ~0.7 ms
    registry = admit(engine, store, prompt)
    assert store.asked == [] and count(registry, "worker_store_lookups", result="slower") == 1
    assert engine.kv_sources["r"] == ComputeKv()


def test_a_faster_store_loads_its_leading_run_past_the_device_hits():
    prompt = list(range(6 * BLOCK + 1))
    hashes = hash_blocks(prompt, BLOCK, FINGERPRINT, "")
    engine = AdmissionRecorder(BLOCK, FINGERPRINT, cached=(2, 0))  # CPU priors: a block computes in 80 ms
    admit(engine, Store(held=hashes[2:5]), prompt)
    assert engine.kv_sources["r"] == StoredKv(5, hashes)
    assert engine.rates.decisions == {(STORE, "loaded"): 3 * BLOCK}


def test_stored_blocks_after_a_host_run_too_slow_to_pay_for_are_recomputed():
    prompt = list(range(6 * BLOCK + 1))
    hashes = hash_blocks(prompt, BLOCK, FINGERPRINT, "")
    engine = AdmissionRecorder(BLOCK, FINGERPRINT, has_host_tier=True, kv_bytes_per_block=1 << 20, cached=(0, 4))
    engine.rates.prefill = Throughput(4000.0)  # 1 ms a block
    engine.rates.loads[HOST] = Throughput(1 << 29)  # 2 ms a block: 4 ms lost over the host run
    engine.rates.loads[STORE] = Throughput(1 << 31)  # 0.5 ms a block: 1 ms saved over the store's two
    admit(engine, Store(held=hashes[4:6]), prompt)
    assert engine.kv_sources["r"] == ComputeKv()  # the engine's own admission decides the host run
    assert engine.rates.decisions == {(STORE, "recomputed"): 2 * BLOCK}
