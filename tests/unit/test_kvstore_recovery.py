"""Restart: the index and byte counts rebuilt from the segments; torn, flipped and killed writes never served."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.dataplane import BlockNotFound
from deepinfer.kvcache.store import StoreEventKind, StoreLockedError
from deepinfer.kvcache.store.records import HEADER_BYTES
from tests.kvstore_harness import LAYOUT, FakeClock, KiB, hashes, metric, open_store, payload, segment_files

ROOT = Path(__file__).resolve().parents[2]
#: Bytes of one 4 KiB block's record; blocks written in one call lie back to back from offset 0 of a segment.
RECORD_BYTES = HEADER_BYTES + len(LAYOUT) + 16 + 4 * KiB
NAMES = ["a", "b", "c"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _write_abc(tmp_path: Path, clock: FakeClock) -> Path:
    store, _ = open_store(tmp_path, clock)
    store.write_blocks(LAYOUT, hashes(*NAMES), [payload(n) for n in NAMES])
    store.close()
    [segment] = segment_files(tmp_path)
    assert segment.stat().st_size == 3 * RECORD_BYTES
    return segment


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_reopen_rebuilds_the_index_and_the_byte_counts(tmp_path, clock):
    store, _ = open_store(tmp_path, clock, segment_bytes=8 * RECORD_BYTES, touch_interval_s=0)
    names = [f"block-{i}" for i in range(20)]
    store.write_blocks(LAYOUT, hashes(*names), [payload(n) for n in names])
    clock.advance(5)
    store.read_blocks("", [], hashes(*names[:5]), LAYOUT)  # touch records too
    before = store.stats()
    store.close()
    reopened, registry = open_store(tmp_path, clock, ram_bytes=0, segment_bytes=8 * RECORD_BYTES)
    after = reopened.stats()
    assert (after.num_disk_blocks, after.disk_live_bytes, after.disk_file_bytes, after.num_segments) == (
        before.num_disk_blocks,
        before.disk_live_bytes,
        before.disk_file_bytes,
        3,
    )
    assert after.disk_file_bytes == sum(p.stat().st_size for p in segment_files(tmp_path))
    assert metric(registry, "kvstore_bytes", tier="disk") == before.disk_live_bytes
    assert metric(registry, "kvstore_disk_file_bytes") == after.disk_file_bytes
    assert reopened.read_blocks("", [], hashes(*names), LAYOUT) == [payload(n) for n in names]
    assert reopened.take_events() == []  # nothing changed: a restart announces nothing
    reopened.close()


def test_a_truncated_tail_record_is_cut_off_reported_and_never_served(tmp_path, clock, caplog):
    segment = _write_abc(tmp_path, clock)
    os.truncate(segment, 2 * RECORD_BYTES + RECORD_BYTES // 2)  # "c" half written
    with caplog.at_level(logging.WARNING, logger="deepinfer.kvcache.store"):
        store, registry = open_store(tmp_path, clock)
    assert "dropped 1 truncated record(s)" in caplog.text
    assert metric(registry, "kvstore_corrupt_records_total", reason="truncated") == 1
    assert segment.stat().st_size == 2 * RECORD_BYTES  # the torn bytes are gone
    assert store.has_blocks(LAYOUT, hashes(*NAMES)) == [True, True, False]
    assert store.read_blocks("", [], hashes("a", "b"), LAYOUT) == [payload("a"), payload("b")]
    with pytest.raises(BlockNotFound):
        store.read_blocks("", [], hashes("c"), LAYOUT)
    store.write_blocks(LAYOUT, hashes("c"), [payload("c")])  # stored again, in a new segment
    assert store.read_blocks("", [], hashes("c"), LAYOUT) == [payload("c")]
    store.close()


def test_a_flipped_payload_byte_is_detected_on_open(tmp_path, clock):
    segment = _write_abc(tmp_path, clock)
    _flip(segment, RECORD_BYTES + RECORD_BYTES - 100)  # inside "b"'s payload
    store, registry = open_store(tmp_path, clock, ram_bytes=0)
    assert metric(registry, "kvstore_corrupt_records_total", reason="checksum") == 1
    assert store.has_blocks(LAYOUT, hashes(*NAMES)) == [True, False, True]
    assert store.read_blocks("", [], hashes("a", "c"), LAYOUT) == [payload("a"), payload("c")]
    with pytest.raises(BlockNotFound):
        store.read_blocks("", [], hashes("b"), LAYOUT)
    store.close()


def test_with_lazy_verification_a_flipped_payload_byte_is_caught_on_read(tmp_path, clock):
    segment = _write_abc(tmp_path, clock)
    _flip(segment, RECORD_BYTES + RECORD_BYTES - 100)
    store, registry = open_store(tmp_path, clock, ram_bytes=0, verify_on_open=False)
    assert store.has_blocks(LAYOUT, hashes(*NAMES)) == [True, True, True]  # headers only so far
    with pytest.raises(BlockNotFound):
        store.read_blocks("", [], hashes("b"), LAYOUT)
    assert metric(registry, "kvstore_corrupt_records_total", reason="checksum") == 1
    assert store.has_blocks(LAYOUT, hashes(*NAMES)) == [True, False, True]
    assert [e.kind for e in store.take_events()] == [StoreEventKind.EVICTED]
    assert store.read_blocks("", [], hashes("a", "c"), LAYOUT) == [payload("a"), payload("c")]
    store.close()


def test_a_damaged_header_loses_only_its_record(tmp_path, clock):
    segment = _write_abc(tmp_path, clock)
    _flip(segment, RECORD_BYTES + HEADER_BYTES + 2)  # inside "b"'s key: its header checksum fails
    store, registry = open_store(tmp_path, clock, ram_bytes=0)
    assert metric(registry, "kvstore_corrupt_records_total", reason="header") == 1
    assert store.has_blocks(LAYOUT, hashes(*NAMES)) == [True, False, True]  # "c" found past the damage
    assert store.read_blocks("", [], hashes("a", "c"), LAYOUT) == [payload("a"), payload("c")]
    store.close()


def test_a_second_store_on_the_same_directory_is_refused(tmp_path, clock):
    store, _ = open_store(tmp_path, clock)
    with pytest.raises(StoreLockedError):
        open_store(tmp_path, clock)
    store.close()
    open_store(tmp_path, clock)[0].close()  # released by close


_WRITER = """
import sys, time
from tests.kvstore_harness import FakeClock, hashes, open_store, payload, LAYOUT
from pathlib import Path
store, _ = open_store(Path(sys.argv[1]), FakeClock(), segment_bytes=1 << 20, disk_bytes=1 << 30)
i = 0
while True:  # batches of 8 blocks until killed; a line after each batch that write_blocks returned for
    names = [f"{i}-{j}" for j in range(8)]
    store.write_blocks(LAYOUT, hashes(*names), [payload(n, 64 * 1024) for n in names])
    print(i, flush=True)
    i += 1
"""


def test_kill_9_after_write_blocks_returned_loses_nothing(tmp_path, clock):
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        acknowledged = [int(writer.stdout.readline()) for _ in range(20)]
    finally:
        os.kill(writer.pid, signal.SIGKILL)  # most likely mid-batch: the next write_blocks is running
        writer.wait(timeout=30)
        writer.stdout.close()
    assert writer.returncode == -signal.SIGKILL and acknowledged == list(range(20))
    store, registry = open_store(tmp_path, clock, ram_bytes=0, disk_bytes=1 << 30, segment_bytes=1 << 20)
    names = [f"{i}-{j}" for i in acknowledged for j in range(8)]
    assert store.read_blocks("", [], hashes(*names), LAYOUT) == [payload(n, 64 * 1024) for n in names]
    # Whatever of the unacknowledged batches made it is whole and correct, or missing (a torn tail).
    later = [f"{i}-{j}" for i in range(20, 20 + 1000) for j in range(8)]
    present = [n for n, held in zip(later, store.has_blocks(LAYOUT, hashes(*later)), strict=True) if held]
    assert store.read_blocks("", [], hashes(*present), LAYOUT) == [payload(n, 64 * 1024) for n in present]
    assert metric(registry, "kvstore_corrupt_records_total", reason="checksum") == 0
    store.close()
