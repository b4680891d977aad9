"""Compaction: dead records reclaimed in bounded steps, live blocks (and their last use) kept across a restart."""

from __future__ import annotations

import os

import pytest

from deepinfer.dataplane import BlockNotFound
from deepinfer.kvcache.store import StoreEventKind
from deepinfer.kvcache.store.records import HEADER_BYTES
from tests.kvstore_harness import LAYOUT, FakeClock, KiB, hashes, metric, open_store, payload, segment_files

TTL_S = 3600.0
RECORD_BYTES = HEADER_BYTES + len(LAYOUT) + 16 + 4 * KiB
TOUCH_BYTES = HEADER_BYTES + len(LAYOUT) + 16
SEGMENT_BYTES = 4 * RECORD_BYTES
NAMES = [f"block-{i:02d}" for i in range(12)]  # three full segments
KEEP = NAMES[::4]  # one live block per segment: every segment falls under the 0.5 live fraction


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _store_with_dead_bytes(tmp_path, clock, **overrides):
    store, registry = open_store(
        tmp_path,
        clock,
        ram_bytes=0,
        segment_bytes=SEGMENT_BYTES,
        ttl_s=TTL_S,
        touch_interval_s=60,
        **overrides,
    )
    store.write_blocks(LAYOUT, hashes(*NAMES), [payload(n) for n in NAMES])
    clock.advance(TTL_S / 2)
    store.read_blocks("", [], hashes(*KEEP), LAYOUT)  # a touch record each
    clock.advance(TTL_S / 2 + 1)
    assert store.expire() == len(NAMES) - len(KEEP)
    return store, registry


def test_compaction_reclaims_dead_records_and_keeps_live_blocks(tmp_path, clock):
    store, registry = _store_with_dead_bytes(tmp_path, clock)
    before = store.stats()
    assert before.disk_file_bytes > 12 * RECORD_BYTES and before.disk_live_bytes < 4 * RECORD_BYTES
    progress = store.compact()
    after = store.stats()
    assert progress.done and progress.reclaimed_bytes == 3 * SEGMENT_BYTES  # the three sealed segments
    assert (
        after.disk_live_bytes == len(KEEP) * RECORD_BYTES
    )  # each copy carries its last use: touches folded in
    # Left: the copies, after the three touch records (now dead) in the active segment, under the threshold.
    assert after.disk_file_bytes == after.disk_live_bytes + len(KEEP) * TOUCH_BYTES
    assert after.num_segments == 1 and len(segment_files(tmp_path)) == 1
    assert metric(registry, "kvstore_compacted_bytes_total") == progress.reclaimed_bytes
    assert store.read_blocks("", [], hashes(*KEEP), LAYOUT) == [payload(n) for n in KEEP]
    assert store.compact_step().done  # nothing left to do
    store.read_blocks("", [], hashes(*KEEP), LAYOUT)  # later uses: touch records again
    closing = store.stats()
    store.close()
    clock.advance(TTL_S / 2 - 2)  # the kept blocks' last use survived the rewrite: not expired yet
    reopened, _ = open_store(tmp_path, clock, ram_bytes=0, ttl_s=TTL_S)
    assert reopened.stats() == closing
    assert reopened.read_blocks("", [], hashes(*KEEP), LAYOUT) == [payload(n) for n in KEEP]
    reopened.close()


def test_compaction_runs_in_bounded_steps_with_reads_between(tmp_path, clock):
    store, _ = _store_with_dead_bytes(tmp_path, clock, compact_step_bytes=RECORD_BYTES)
    steps = [store.compact_step()]
    while not steps[-1].done:
        assert store.read_blocks("", [], hashes(*KEEP), LAYOUT) == [payload(n) for n in KEEP]
        steps.append(store.compact_step())
    # One victim per step (each holds one live record), each step copying one record and deleting its victim.
    assert [(s.copied_bytes, s.reclaimed_bytes) for s in steps] == [(RECORD_BYTES, SEGMENT_BYTES)] * 3
    stats = store.stats()
    # Left: the copies, plus touch records (live ones from the reads between steps, dead superseded ones).
    assert stats.num_segments == 1
    assert (stats.disk_live_bytes - len(KEEP) * RECORD_BYTES) % TOUCH_BYTES == 0
    assert (stats.disk_file_bytes - stats.disk_live_bytes) % TOUCH_BYTES == 0
    store.close()


def test_a_sealed_segment_with_enough_live_data_is_left_alone(tmp_path, clock):
    store, _ = open_store(tmp_path, clock, ram_bytes=0, segment_bytes=SEGMENT_BYTES, ttl_s=TTL_S)
    store.write_blocks(LAYOUT, hashes(*NAMES[:8]), [payload(n) for n in NAMES[:8]])
    clock.advance(TTL_S / 2)
    store.read_blocks("", [], hashes(*NAMES[:3], *NAMES[4:6]), LAYOUT)  # 3 of 4, then 2 of 4 stay live
    clock.advance(TTL_S / 2 + 1)
    store.expire()
    files = segment_files(tmp_path)
    progress = store.compact()
    assert (
        progress.reclaimed_bytes == 0 and segment_files(tmp_path) == files
    )  # 0.75 and 0.5 live: not under 0.5
    store.close()


def test_over_capacity_files_shrink_to_the_live_bytes(tmp_path, clock):
    store, _ = open_store(
        tmp_path,
        clock,
        ram_bytes=0,
        segment_bytes=SEGMENT_BYTES,
        disk_bytes=8 * RECORD_BYTES,
        compact_live_fraction=0.1,
    )
    store.write_blocks(LAYOUT, hashes(*NAMES), [payload(n) for n in NAMES])  # 4 evicted for capacity
    assert store.stats().disk_file_bytes == 12 * RECORD_BYTES > 8 * RECORD_BYTES
    store.compact()
    stats = store.stats()
    assert stats.disk_file_bytes == stats.disk_live_bytes == 8 * RECORD_BYTES
    assert store.read_blocks("", [], hashes(*NAMES[4:]), LAYOUT) == [payload(n) for n in NAMES[4:]]
    store.close()


def test_a_record_damaged_while_open_is_dropped_by_compaction_never_copied(tmp_path, clock):
    store, registry = _store_with_dead_bytes(tmp_path, clock)
    victim = segment_files(tmp_path)[1]  # holds KEEP[1] = block-04 at offset 0
    fd = os.open(victim, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff", RECORD_BYTES - 10)  # the last payload byte of block-04
    finally:
        os.close(fd)
    store.take_events()
    store.compact()
    assert metric(registry, "kvstore_corrupt_records_total", reason="checksum") == 1
    assert [(e.kind, e.block_hash) for e in store.take_events()] == [
        (StoreEventKind.EVICTED, hashes(KEEP[1])[0])
    ]
    with pytest.raises(BlockNotFound):
        store.read_blocks("", [], hashes(KEEP[1]), LAYOUT)
    others = [n for n in KEEP if n != KEEP[1]]
    assert store.read_blocks("", [], hashes(*others), LAYOUT) == [payload(n) for n in others]
    store.close()
