"""Load or recompute (deepinfer.kv_costs) and the rates it is fed (deepinfer.kv_rates): exact prefix lengths for
given rates, priors replaced by measurements."""

from __future__ import annotations

import pytest

from deepinfer.kv_costs import DEVICE, HOST, STORE, KvCosts
from deepinfer.kv_rates import (
    HOST_PRIOR_BYTES_PER_S,
    STORE_PRIOR_BYTES_PER_S,
    STORE_SHM,
    STORE_SHM_PRIOR_BYTES_PER_S,
    MeasuredRates,
    Throughput,
)

MIB = 1 << 20


def costs(host: float | None, store: float | None, prefill: float = 16_000.0) -> KvCosts:
    """16-token blocks of 2 MiB (the 8B shape): one block computes in 1 ms at 16k tokens/s."""
    return KvCosts(block_size=16, kv_bytes_per_block=2 * MIB, prefill_tokens_per_s=prefill,
                   host_bytes_per_s=host, store_bytes_per_s=store)


def test_every_tier_faster_than_computing_is_loaded_whole():
    rule = costs(host=40e9, store=4 * MIB * 1000)  # store: 0.5 ms a block against 1 ms to compute it
    runs = [(DEVICE, 3), (HOST, 5), (STORE, 7)]
    assert rule.blocks_to_load(runs) == 15
    # 15 blocks computed: 15 ms; loaded: 3 device blocks free, 5 × 2 MiB at 40 GB/s, 7 × 0.5 ms
    assert rule.seconds_saved(runs) == pytest.approx(0.015 - 5 * 2 * MIB / 40e9 - 0.0035)
    assert rule.tokens_saved(runs) == pytest.approx(rule.seconds_saved(runs) * 16_000)


def test_a_store_slower_than_computing_is_recomputed():
    rule = costs(host=40e9, store=1 * MIB * 1000)  # 2 ms a block: twice the 1 ms of computing it
    assert not rule.worth_loading(STORE) and rule.worth_loading(HOST)
    assert rule.blocks_to_load([(DEVICE, 3), (HOST, 5), (STORE, 7)]) == 8
    assert rule.blocks_to_load([(DEVICE, 0), (HOST, 0), (STORE, 7)]) == 0
    assert rule.seconds_saved([(DEVICE, 0), (HOST, 0), (STORE, 7)]) == 0.0


def test_device_blocks_cost_nothing_and_are_always_kept():
    rule = costs(host=None, store=None)
    runs = [(DEVICE, 4), (HOST, 2), (STORE, 9)]
    assert rule.blocks_to_load(runs) == 4
    assert rule.seconds_saved(runs) == pytest.approx(4 * 0.001)


def test_a_missing_tier_ends_the_loadable_prefix():
    rule = costs(host=None, store=40e9)  # no host tier: its blocks cannot be loaded, so neither can the store's
    assert rule.blocks_to_load([(DEVICE, 1), (HOST, 2), (STORE, 9)]) == 1
    assert rule.blocks_to_load([(DEVICE, 1), (HOST, 0), (STORE, 9)]) == 10


def test_a_slow_run_is_loaded_when_a_fast_run_after_it_pays_for_it():
    rule = costs(host=1 * MIB * 1000 * 2 / 3, store=40e9)  # host: 3 ms a block (2 ms lost each); store ~free
    assert rule.blocks_to_load([(DEVICE, 0), (HOST, 2), (STORE, 10)]) == 12  # lose 4 ms, save ~10 ms
    assert rule.blocks_to_load([(DEVICE, 0), (HOST, 4), (STORE, 3)]) == 0  # lose 8 ms, save ~3 ms


def test_a_tie_loads():
    rule = costs(host=2 * MIB * 1000, store=None)  # exactly 1 ms a block, as computing it
    assert rule.blocks_to_load([(DEVICE, 0), (HOST, 5)]) == 5


def test_a_throughput_starts_at_its_prior_and_weighs_bytes_not_loads():
    rate = Throughput(prior=7.0)
    assert rate.rate == 7.0
    rate.observe(0, 1.0)
    rate.observe(10, 0.0)
    assert rate.rate == 7.0 and rate.num_samples == 0
    rate.observe(100, 1.0)
    assert rate.rate == 100.0  # the first sample replaces the prior
    rate.observe(1000, 1.0)  # sums: 0.5 × 100 + 1000 over 0.5 × 1 + 1
    assert rate.rate == pytest.approx(1050 / 1.5)


def test_measured_rates_start_from_the_priors_of_their_device():
    rates = MeasuredRates.for_device("cpu")
    assert rates.prefill.rate == 50.0
    assert MeasuredRates.for_device("cuda").prefill.rate == 17_000.0
    assert MeasuredRates.for_device("npu").prefill.rate == 17_000.0
    rule = rates.costs(16, 2 * MIB, host=True, store_path=STORE_SHM)
    assert (rule.host_bytes_per_s, rule.store_bytes_per_s) == (HOST_PRIOR_BYTES_PER_S, STORE_SHM_PRIOR_BYTES_PER_S)
    assert rates.costs(16, 2 * MIB, host=True, store_path=STORE).store_bytes_per_s == STORE_PRIOR_BYTES_PER_S
    assert rates.costs(16, 2 * MIB, host=False, store_path=None) == KvCosts(16, 2 * MIB, 50.0, None, None)


def test_measurements_replace_the_priors():
    rates = MeasuredRates.for_device("cuda")
    rates.observe_step(31, 0.001, block_size=16)  # under two blocks' tokens: a step's fixed cost, not measured
    assert rates.prefill.rate == 17_000.0
    rates.observe_step(4096, 0.128, block_size=16)
    rates.observe_load(STORE, 64 * MIB, 0.016)
    rule = rates.costs(16, 2 * MIB, host=True, store_path=STORE)
    assert rule.prefill_tokens_per_s == 32_000.0
    assert rule.store_bytes_per_s == 4 * MIB * 1000
    assert rule.host_bytes_per_s == HOST_PRIOR_BYTES_PER_S


def test_decisions_count_tokens_by_tier_and_outcome():
    rates = MeasuredRates.for_device("cpu")
    rates.decided(HOST, 64, 0)
    rates.decided(STORE, 0, 32)
    rates.decided(HOST, 16, 0)
    assert rates.decisions == {(HOST, "loaded"): 80, (STORE, "recomputed"): 32}


def test_a_workers_metrics_show_the_rates_and_the_decided_tokens():
    from deepinfer.telemetry import new_registry
    from deepinfer.worker.kv_cost_metrics import KvCostMetrics

    rates, registry = MeasuredRates.for_device("cpu"), new_registry(process_metrics=False)
    metrics = KvCostMetrics(registry, rates)
    rates.observe_load(STORE, 3_000, 0.001)
    rates.decided(HOST, 64, 0)
    rates.decided(STORE, 0, 32)
    metrics.update()
    rates.decided(HOST, 16, 0)
    metrics.update()

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"deepinfer_{name}", labels)

    assert sample("worker_prefill_tokens_per_second") == 50.0
    assert sample("worker_kv_load_bytes_per_second", path=STORE) == 3e6
    assert sample("worker_kv_load_bytes_per_second", path=STORE_SHM) == STORE_SHM_PRIOR_BYTES_PER_S
    assert sample("worker_kv_load_decision_tokens_total", tier=HOST, decision="loaded") == 80
    assert sample("worker_kv_load_decision_tokens_total", tier=STORE, decision="recomputed") == 32
    assert sample("worker_kv_load_decision_tokens_total", tier=STORE, decision="loaded") == 0


def test_kv_load_choice_load_loads_whatever_a_tier_holds():
    slow = MeasuredRates.for_device("cuda", always_load=True)
    slow.observe_load(STORE, 2 * MIB, 1.0)  # 2 MiB/s: ~1000x slower than computing a block
    rule = slow.costs(16, 2 * MIB, host=False, store_path=STORE)
    assert rule.worth_loading(STORE) and not rule.worth_loading(HOST)  # no host tier: still nothing to load
    assert rule.blocks_to_load([(DEVICE, 3), (HOST, 0), (STORE, 7)]) == 10
    measured = MeasuredRates.for_device("cuda")
    measured.observe_load(STORE, 2 * MIB, 1.0)
    assert measured.costs(16, 2 * MIB, host=False, store_path=STORE).blocks_to_load(
        [(DEVICE, 3), (HOST, 0), (STORE, 7)]) == 3
