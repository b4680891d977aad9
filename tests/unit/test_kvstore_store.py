"""The store as a BlockProvider: put / get / has by (layout_id, hash), misses, events, metrics (temp dir, fake clock)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from deepinfer.dataplane import BlockNotFound, DataPlaneError
from deepinfer.kvcache.store import FsyncPolicy, KvStore, StoreEventKind, StoreMetrics, StoreSettings
from deepinfer.kvcache.store import segments as segments_module
from tests.kvstore_harness import (
    LAYOUT,
    OTHER_LAYOUT,
    FakeClock,
    KiB,
    hashes,
    metric,
    open_store,
    payload,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_put_then_get_returns_the_same_bytes_in_request_order(tmp_path, clock):
    store, _ = open_store(tmp_path, clock)
    names = ["a", "b", "c"]
    store.write_blocks(LAYOUT, hashes(*names), [payload(n) for n in names])
    got = store.read_blocks("", [], hashes("c", "a", "b", "a"), LAYOUT)
    assert got == [payload("c"), payload("a"), payload("b"), payload("a")]
    store.close()


def test_has_answers_per_hash_and_is_not_a_use(tmp_path, clock):
    store, registry = open_store(tmp_path, clock)
    store.write_blocks(LAYOUT, hashes("a", "b"), [payload("a"), payload("b")])
    assert store.has_blocks(LAYOUT, hashes("a", "x", "b")) == [True, False, True]
    assert metric(registry, "kvstore_hits_total", tier="ram") == 0  # a probe, not a read
    store.close()


def test_a_block_of_another_layout_is_never_served(tmp_path, clock):
    store, _ = open_store(tmp_path, clock)
    store.write_blocks(LAYOUT, hashes("a"), [payload("a")])
    assert store.has_blocks(OTHER_LAYOUT, hashes("a")) == [False]
    with pytest.raises(BlockNotFound):
        store.read_blocks("", [], hashes("a"), OTHER_LAYOUT)
    # The same hash under the other layout is another object, with its own bytes.
    store.write_blocks(OTHER_LAYOUT, hashes("a"), [payload("a-in-b")])
    assert store.read_blocks("", [], hashes("a"), LAYOUT) == [payload("a")]
    assert store.read_blocks("", [], hashes("a"), OTHER_LAYOUT) == [payload("a-in-b")]
    store.close()
    reopened, _ = open_store(tmp_path, clock, ram_bytes=0)  # and from disk, after a restart
    assert reopened.read_blocks("", [], hashes("a"), OTHER_LAYOUT) == [payload("a-in-b")]
    assert reopened.read_blocks("", [], hashes("a"), LAYOUT) == [payload("a")]
    reopened.close()


def test_a_miss_is_a_clean_block_not_found_and_serves_nothing(tmp_path, clock):
    store, registry = open_store(tmp_path, clock)
    store.write_blocks(LAYOUT, hashes("a"), [payload("a")])
    with pytest.raises(BlockNotFound, match="1 block.*not held under layout 'layout-a', first 6d"):
        store.read_blocks("", [], hashes("a", "missing"), LAYOUT)
    assert metric(registry, "kvstore_misses_total", tier="ram") == 1
    assert metric(registry, "kvstore_misses_total", tier="disk") == 1
    assert metric(registry, "kvstore_hits_total", tier="ram") == 0  # all or nothing: "a" was not read
    store.close()


def test_reads_by_block_id_and_an_empty_layout_are_refused(tmp_path, clock):
    store, _ = open_store(tmp_path, clock)
    with pytest.raises(DataPlaneError, match="by hash"):
        store.read_blocks("req-1", [3], [], LAYOUT)
    with pytest.raises(DataPlaneError, match="layout_id"):
        store.write_blocks("", hashes("a"), [payload("a")])
    store.close()


def test_a_second_put_of_a_held_block_keeps_the_first_bytes_and_announces_once(tmp_path, clock):
    store, _ = open_store(tmp_path, clock)
    store.write_blocks(LAYOUT, hashes("a", "a"), [payload("a"), payload("a")])
    store.write_blocks(LAYOUT, hashes("a"), [payload("other")])  # immutable: only a use
    assert store.read_blocks("", [], hashes("a"), LAYOUT) == [payload("a")]
    events = store.take_events()
    assert [(e.kind, e.layout_id, e.block_hash) for e in events] == [
        (StoreEventKind.STORED, LAYOUT, hashes("a")[0])
    ]
    assert store.take_events() == []  # drained
    assert store.stats().num_disk_blocks == 1
    store.close()


def test_hits_are_counted_per_tier_with_their_age(tmp_path, clock):
    store, registry = open_store(tmp_path, clock, ram_bytes=4 * KiB)  # room for one block
    store.write_blocks(LAYOUT, hashes("a", "b"), [payload("a"), payload("b")])  # "a" leaves RAM for "b"
    clock.advance(30)
    assert store.read_blocks("", [], hashes("b"), LAYOUT) == [payload("b")]
    assert store.read_blocks("", [], hashes("a"), LAYOUT) == [payload("a")]  # from disk, then promoted
    assert metric(registry, "kvstore_hits_total", tier="ram") == 1
    assert metric(registry, "kvstore_hits_total", tier="disk") == 1
    assert metric(registry, "kvstore_misses_total", tier="ram") == 1  # "a" was looked up in RAM first
    assert metric(registry, "kvstore_hit_age_seconds_sum", tier="ram") == 30
    assert metric(registry, "kvstore_hit_age_seconds_count", tier="disk") == 1
    assert metric(registry, "kvstore_read_seconds_count", tier="disk") == 1
    assert metric(registry, "kvstore_write_seconds_count", tier="disk") == 1
    assert metric(registry, "kvstore_blocks", tier="disk") == 2
    assert metric(registry, "kvstore_bytes", tier="ram") == 4 * KiB
    assert metric(registry, "kvstore_disk_file_bytes") == store.stats().disk_file_bytes > 8 * KiB
    store.close()


def test_a_ram_only_store_evicts_and_announces(tmp_path, clock):
    store = KvStore(StoreSettings(ram_bytes=8 * KiB, disk_dir=None), clock=clock)
    store.write_blocks(LAYOUT, hashes("a", "b", "c"), [payload(n) for n in "abc"])
    assert store.has_blocks(LAYOUT, hashes("a", "b", "c")) == [False, True, True]
    kinds = [(e.kind, e.block_hash) for e in store.take_events()]
    assert (StoreEventKind.EVICTED, hashes("a")[0]) in kinds
    with pytest.raises(DataPlaneError, match="exceeds ram_bytes"):
        store.write_blocks(LAYOUT, hashes("huge"), [payload("huge", 16 * KiB)])
    store.close()


@pytest.mark.parametrize("policy", list(FsyncPolicy))
def test_a_write_syncs_per_policy_and_touch_records_never(tmp_path, clock, monkeypatch, policy):
    store, _ = open_store(tmp_path, clock, fsync=policy, touch_interval_s=0)
    store.write_blocks(LAYOUT, hashes("warm"), [payload("warm")])
    syncs = []
    monkeypatch.setattr(segments_module.os, "fdatasync", syncs.append)
    store.write_blocks(LAYOUT, hashes("a", "b"), [payload("a"), payload("b")])
    assert len(syncs) == {FsyncPolicy.NONE: 0, FsyncPolicy.BATCH: 1, FsyncPolicy.ALWAYS: 2}[policy]
    num_syncs = len(syncs)
    clock.advance(1)
    store.read_blocks("", [], hashes("a", "b"), LAYOUT)  # two due touch records, written unsynced
    assert len(syncs) == num_syncs and store.stats().disk_live_bytes > 3 * (4 * KiB + 64)
    monkeypatch.undo()
    store.close()


def test_a_closed_store_refuses_work(tmp_path, clock):
    store, _ = open_store(tmp_path, clock)
    store.close()
    store.close()  # idempotent
    with pytest.raises(DataPlaneError, match="closed"):
        store.has_blocks(LAYOUT, hashes("a"))


def test_the_docs_example_runs_and_the_metrics_table_names_every_metric():
    text = (Path(__file__).resolve().parents[2] / "docs" / "kvstore.md").read_text()
    [example] = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    namespace: dict = {}
    exec(compile(example, "docs/kvstore.md", "exec"), namespace)
    assert [e.kind for e in namespace["events"]] == [StoreEventKind.STORED]
    registry = CollectorRegistry()
    StoreMetrics(registry)
    exported = {m.name.removeprefix("deepinfer_") for m in registry.collect()}
    documented = {name.removesuffix("_total") for name in re.findall(r"`(kvstore_[a-z_]+)`", text)}
    assert exported == documented
