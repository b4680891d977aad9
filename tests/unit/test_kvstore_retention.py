"""Retention: LRU by bytes in each tier (exact keys), TTL since last use in both tiers and across a restart."""

from __future__ import annotations

import pytest

from deepinfer.dataplane import BlockNotFound
from deepinfer.kvcache.store import StoreEventKind, Tier
from deepinfer.kvcache.store.ram import RamTier
from deepinfer.kvcache.store.records import HEADER_BYTES
from tests.kvstore_harness import LAYOUT, FakeClock, KiB, hashes, metric, open_store, payload

TTL_S = 3600.0
#: Bytes of one 4 KiB block's disk record (header + layout_id + hash + payload).
RECORD_BYTES = HEADER_BYTES + len(LAYOUT) + 16 + 4 * KiB


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_ram_tier_evicts_least_recently_used_by_bytes():
    ram = RamTier(capacity_bytes=10)
    key = {n: (LAYOUT, n.encode()) for n in "abcde"}
    assert ram.put(key["a"], b"x" * 4, 1.0) == []
    assert ram.put(key["b"], b"x" * 3, 2.0) == []
    assert ram.put(key["c"], b"x" * 3, 3.0) == []  # exactly full: 10 bytes
    ram.use(key["a"], 4.0)  # order now b, c, a
    assert ram.put(key["d"], b"x" * 5, 5.0) == [key["b"], key["c"]]  # 3 + 3 freed for 5
    assert ram.keys() == [key["a"], key["d"]] and ram.used_bytes == 9
    assert ram.put(key["e"], b"x" * 11, 6.0) == []  # larger than the tier: not held, nothing evicted
    assert key["e"] not in ram and ram.used_bytes == 9


def test_store_ram_tier_keeps_the_most_recently_used_blocks(tmp_path, clock):
    store, registry = open_store(tmp_path, clock, ram_bytes=12 * KiB)  # three 4 KiB blocks
    store.write_blocks(LAYOUT, hashes("a", "b", "c"), [payload(n) for n in "abc"])
    store.read_blocks("", [], hashes("a"), LAYOUT)  # RAM order: b, c, a
    store.write_blocks(LAYOUT, hashes("d"), [payload("d")])  # evicts b from RAM only
    assert [k[1] for k in store.held_keys(Tier.RAM)] == hashes("c", "a", "d")
    assert metric(registry, "kvstore_evictions_total", tier="ram") == 1
    assert store.has_blocks(LAYOUT, hashes("b")) == [True]  # still on disk: no event, still served
    assert store.read_blocks("", [], hashes("b"), LAYOUT) == [payload("b")]
    assert [k[1] for k in store.held_keys(Tier.RAM)] == hashes("a", "d", "b")  # promoted, c left
    assert [e.kind for e in store.take_events()] == [StoreEventKind.STORED] * 4
    store.close()


def test_disk_tier_evicts_least_recently_used_within_disk_bytes(tmp_path, clock):
    store, registry = open_store(tmp_path, clock, ram_bytes=0, disk_bytes=3 * RECORD_BYTES)
    store.write_blocks(LAYOUT, hashes("a", "b", "c"), [payload(n) for n in "abc"])
    clock.advance(1)
    store.read_blocks("", [], hashes("a"), LAYOUT)  # disk LRU order: b, c, a
    store.write_blocks(LAYOUT, hashes("d"), [payload("d")])
    assert store.has_blocks(LAYOUT, hashes("a", "b", "c", "d")) == [True, False, True, True]
    store.write_blocks(LAYOUT, hashes("e"), [payload("e")])
    assert store.has_blocks(LAYOUT, hashes("a", "c", "d", "e")) == [True, False, True, True]
    assert [k[1] for k in store.held_keys(Tier.DISK)] == hashes("a", "d", "e")
    evicted = [e.block_hash for e in store.take_events() if e.kind == StoreEventKind.EVICTED]
    assert evicted == hashes("b", "c")
    assert metric(registry, "kvstore_evictions_total", tier="disk") == 2
    assert store.stats().disk_live_bytes == 3 * RECORD_BYTES
    with pytest.raises(BlockNotFound):
        store.read_blocks("", [], hashes("b"), LAYOUT)
    store.close()


def test_blocks_expire_after_ttl_since_last_use_in_both_tiers(tmp_path, clock):
    store, registry = open_store(tmp_path, clock, ram_bytes=8 * KiB, ttl_s=TTL_S)
    store.write_blocks(LAYOUT, hashes("ram", "disk", "used"), [payload(n) for n in ("ram", "disk", "used")])
    store.read_blocks("", [], hashes("ram"), LAYOUT)  # RAM holds "used" and "ram"; "disk" only on disk
    clock.advance(TTL_S / 2)
    store.read_blocks("", [], hashes("used"), LAYOUT)  # a use restarts its TTL
    clock.advance(TTL_S / 2)
    assert store.has_blocks(LAYOUT, hashes("ram", "disk", "used")) == [
        True,
        True,
        True,
    ]  # exactly ttl_s: kept
    clock.advance(1)
    assert store.has_blocks(LAYOUT, hashes("ram", "disk", "used")) == [False, False, True]
    assert store.expire() == 2
    expired = {e.block_hash for e in store.take_events() if e.kind == StoreEventKind.EXPIRED}
    assert expired == set(hashes("ram", "disk"))
    assert metric(registry, "kvstore_expirations_total", tier="disk") == 2
    assert metric(registry, "kvstore_expirations_total", tier="ram") == 1
    assert store.stats().num_disk_blocks == 1 and store.stats().num_ram_blocks == 1
    clock.advance(TTL_S / 2 - 1)
    assert store.read_blocks("", [], hashes("used"), LAYOUT) == [
        payload("used")
    ]  # exactly ttl_s since its use
    store.close()


def test_an_expired_block_is_a_miss_even_before_the_sweep(tmp_path, clock):
    store, registry = open_store(tmp_path, clock, ttl_s=TTL_S)
    store.write_blocks(LAYOUT, hashes("a"), [payload("a")])
    clock.advance(TTL_S + 1)
    with pytest.raises(BlockNotFound):
        store.read_blocks("", [], hashes("a"), LAYOUT)
    assert [e.kind for e in store.take_events()] == [StoreEventKind.STORED, StoreEventKind.EXPIRED]
    assert metric(registry, "kvstore_expirations_total", tier="disk") == 1
    store.write_blocks(LAYOUT, hashes("a"), [payload("a")])  # a put after expiry stores it afresh
    assert store.read_blocks("", [], hashes("a"), LAYOUT) == [payload("a")]
    store.close()


def test_expiry_after_a_restart_counts_from_the_recorded_last_use(tmp_path, clock):
    store, _ = open_store(tmp_path, clock, ttl_s=TTL_S, touch_interval_s=60)
    store.write_blocks(LAYOUT, hashes("idle", "used"), [payload("idle"), payload("used")])
    clock.advance(TTL_S / 2)
    store.read_blocks("", [], hashes("used"), LAYOUT)  # due: a touch record reaches the disk
    store.close()
    clock.advance(TTL_S / 2 + 1)  # "idle" is past its TTL, "used" is not
    reopened, registry = open_store(tmp_path, clock, ttl_s=TTL_S, touch_interval_s=60)
    assert reopened.has_blocks(LAYOUT, hashes("idle", "used")) == [False, True]
    assert metric(registry, "kvstore_expirations_total", tier="disk") == 1  # dropped on open
    reopened.close()
    clock.advance(TTL_S / 2)
    again, _ = open_store(tmp_path, clock, ttl_s=TTL_S, touch_interval_s=60)
    assert again.has_blocks(LAYOUT, hashes("used")) == [False]
    again.close()


def test_a_use_within_the_touch_interval_is_not_written_and_ages_the_block_by_at_most_that(tmp_path, clock):
    store, _ = open_store(tmp_path, clock, ttl_s=TTL_S, touch_interval_s=600)
    store.write_blocks(LAYOUT, hashes("a"), [payload("a")])
    file_bytes = store.stats().disk_file_bytes
    clock.advance(300)
    store.read_blocks("", [], hashes("a"), LAYOUT)  # 300 s < touch_interval_s: in memory only
    assert store.stats().disk_file_bytes == file_bytes
    store.close()
    # After the restart the block's last use is its put, 300 s before the true one (< touch_interval_s).
    clock.advance(TTL_S - 300 + 1)
    reopened, _ = open_store(tmp_path, clock, ttl_s=TTL_S, touch_interval_s=600)
    assert reopened.has_blocks(LAYOUT, hashes("a")) == [False]
    reopened.close()
