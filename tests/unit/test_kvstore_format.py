"""The on-disk format: record headers, scanning a segment (torn tail, damaged header, bad payload), fsync policy."""

from __future__ import annotations

import os

import pytest

from deepinfer.kvcache.store import segments as segments_module
from deepinfer.kvcache.store.records import (
    HEADER_BYTES,
    RecordError,
    RecordKind,
    block_head,
    decode_head,
    encode_head,
    touch_head,
)
from deepinfer.kvcache.store.scan import CorruptReason, scan_segment
from deepinfer.kvcache.store.segments import SegmentLog
from deepinfer.kvcache.store.settings import FsyncPolicy, StoreSettings
from tests.kvstore_harness import LAYOUT, block_hash, hashes, payload


def _record(name: str, size_bytes: int = 100, ts: float = 5.0) -> bytes:
    data = payload(name, size_bytes)
    return encode_head(block_head(LAYOUT, block_hash(name), data, ts)) + data


def test_a_header_round_trips_and_locates_its_payload():
    data = payload("a", 100)
    head = block_head(LAYOUT, block_hash("a"), data, 1234.5)
    encoded = encode_head(head)
    assert len(encoded) == HEADER_BYTES + len(LAYOUT) + 16 == head.payload_offset
    decoded = decode_head(memoryview(encoded + data), 0)
    assert decoded == head and decoded.record_bytes == len(encoded) + 100
    touch = touch_head(LAYOUT, block_hash("a"), 99.0)
    assert decode_head(memoryview(encode_head(touch)), 0) == touch and touch.kind == RecordKind.TOUCH


@pytest.mark.parametrize("offset", [0, 5, 8, 16, 24, 32, HEADER_BYTES + 1, HEADER_BYTES + len(LAYOUT) + 3])
def test_any_flipped_header_or_key_byte_is_refused(offset):
    record = bytearray(_record("a"))
    record[offset] ^= 0x40
    with pytest.raises(RecordError):
        decode_head(memoryview(bytes(record)), 0)


def test_a_cut_header_is_refused():
    with pytest.raises(RecordError, match="cut short"):
        decode_head(memoryview(_record("a")[: HEADER_BYTES - 1]), 0)


def test_key_parts_are_bounded():
    with pytest.raises(ValueError, match="1..255 bytes"):
        encode_head(block_head("", block_hash("a"), b"x", 0.0))


def test_scan_finds_every_record_and_resyncs_after_damage(tmp_path):
    records = [_record(n) for n in "abcd"]
    path = tmp_path / "0000000001.seg"
    damaged = bytearray(b"".join(records))
    damaged[len(records[0]) + 3] ^= 0xFF  # b's magic
    damaged[len(records[0]) * 3 - 1] ^= 0xFF  # c's last payload byte
    path.write_bytes(bytes(damaged) + records[0][:50])  # and a torn copy of a at the end
    scan = scan_segment(path, verify_payloads=True)
    assert [r.head.block_hash for r in scan.records] == hashes("a", "d")
    assert [r.offset for r in scan.records] == [0, 3 * len(records[0])]
    assert scan.corrupt == {CorruptReason.HEADER: 1, CorruptReason.CHECKSUM: 1, CorruptReason.TRUNCATED: 1}
    assert scan.valid_end == 4 * len(records[0])
    lazy = scan_segment(path, verify_payloads=False)  # c's payload is not read: left to the per-read check
    assert [r.head.block_hash for r in lazy.records] == hashes("a", "c", "d")


def test_a_segment_of_zeros_after_a_power_loss_is_all_tail(tmp_path):
    path = tmp_path / "0000000001.seg"
    path.write_bytes(_record("a") + bytes(4096))
    scan = scan_segment(path, verify_payloads=True)
    assert len(scan.records) == 1 and scan.valid_end == len(_record("a"))
    assert scan.corrupt == {CorruptReason.TRUNCATED: 1}


def test_segments_roll_at_segment_bytes_and_an_oversized_record_gets_its_own(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=400, fsync=FsyncPolicy.NONE)
    small, big = _record("s"), _record("big", 400)  # 164 and 464 bytes
    assert log.append([(small, None), (small, None), (big, None), (small, None)]) == [
        (1, 0),
        (1, len(small)),
        (2, 0),  # 328 + 464 would pass 400: a new segment, and the big record fills it alone
        (3, 0),
    ]
    assert log.sizes() == {1: 2 * len(small), 2: len(big), 3: len(small)}
    log.close()


@pytest.mark.parametrize(
    ("policy", "num_syncs"), [(FsyncPolicy.NONE, 0), (FsyncPolicy.BATCH, 1), (FsyncPolicy.ALWAYS, 3)]
)
def test_the_fsync_policy_decides_the_syncs_of_an_append(tmp_path, monkeypatch, policy, num_syncs):
    log = SegmentLog(tmp_path, segment_bytes=1 << 20, fsync=policy)
    log.append([(_record("warm"), None)])  # the segment exists (its creation synced the directory)
    syncs = []
    monkeypatch.setattr(segments_module.os, "fdatasync", syncs.append)
    log.append([(_record(n), None) for n in "abc"])
    assert len(syncs) == num_syncs
    log.append([(_record("touch-like"), None)], durable=False)  # never synced on its own
    assert len(syncs) == num_syncs
    log.sync()  # ... but by the next sync, whatever the policy
    assert len(syncs) == num_syncs + 1
    monkeypatch.undo()
    log.close()


def test_settings_are_validated():
    with pytest.raises(ValueError, match="ttl_s"):
        StoreSettings(ttl_s=0)
    with pytest.raises(ValueError, match="hold nothing"):
        StoreSettings(ram_bytes=0, disk_dir=None)
    with pytest.raises(ValueError, match="compact_live_fraction"):
        StoreSettings(compact_live_fraction=1.5)
    assert StoreSettings(disk_dir="x", fsync="batch").fsync == FsyncPolicy.BATCH  # type: ignore[arg-type]
    assert StoreSettings().ttl_s == 72 * 3600 and StoreSettings().fsync == FsyncPolicy.NONE
    assert os.fspath(StoreSettings(disk_dir="x").disk_dir) == "x"  # type: ignore[arg-type]
