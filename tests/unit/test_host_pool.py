"""The host tier's bookkeeping (engine/host_pool.py): slots found only once written, LRU eviction of unpinned
slots, pins held by writes and loads, skips when every slot is pinned, and the host-tier KV events."""

from __future__ import annotations

import pytest

from deepinfer.engine.block_pool import Removed, Stored
from deepinfer.engine.host_pool import HOST_TIER, HostPool


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def fill(pool: HostPool, hashes: list[bytes]) -> list[int]:
    slots = [pool.reserve(x) for x in hashes]
    pool.commit(slots)
    return slots


def test_a_slot_is_a_hit_only_once_committed():
    pool = HostPool(4)
    slot = pool.reserve(h(1))
    assert slot == 0 and pool.lookup(h(1)) is None and h(1) in pool  # being written: no hit, not offloaded again
    assert pool.num_leading_hits([h(1)]) == 0
    pool.commit([slot])
    assert pool.lookup(h(1)) == 0 and pool.num_leading_hits([h(1), h(2)]) == 1
    assert pool.take_events() == [Stored([h(1)], None, tier=HOST_TIER)]
    assert pool.take_events() == []


def test_a_full_pool_evicts_the_least_recently_used_unpinned_slot():
    pool = HostPool(3)
    fill(pool, [h(1), h(2), h(3)])
    pool.take_events()
    pool.unpin(pool.pin([h(1)]))  # a load read h(1): now the most recently used
    slot = pool.reserve(h(4))
    assert slot == 1 and pool.lookup(h(2)) is None  # h(2) was the least recently used
    assert pool.take_events() == [Removed([h(2)], tier=HOST_TIER)]
    pool.commit([slot])
    assert pool.reserve(h(5)) == 2  # then h(3)
    assert pool.block_hashes() == [h(1), h(4)] and pool.num_evictions == 2


def test_pinned_slots_are_never_evicted_and_a_pool_all_pinned_skips():
    pool = HostPool(2)
    fill(pool, [h(1), h(2)])
    pinned = pool.pin([h(1)])  # a load reads it
    writing = pool.reserve(h(3))  # evicts h(2), the only unpinned one
    assert writing == 1 and pool.lookup(h(1)) == 0
    assert pool.reserve(h(4)) is None and pool.num_skipped == 1  # h(1) read, h(3) being written
    assert pool.is_pinned(pinned[0]) and pool.is_pinned(writing)
    pool.unpin(pinned)
    assert pool.reserve(h(4)) == 0  # unpinned: evictable again
    assert pool.lookup(h(1)) is None and pool.lookup(h(3)) is None  # h(3) still not committed


def test_an_aborted_write_frees_its_slot_and_is_never_found():
    pool = HostPool(1)
    slot = pool.reserve(h(1))
    pool.abort([slot])
    assert h(1) not in pool and pool.num_used == 0 and pool.take_events() == []
    assert pool.reserve(h(2)) == slot


def test_pins_must_balance_and_events_can_be_off():
    pool = HostPool(2, enable_events=False)
    fill(pool, [h(1), h(2)])
    with pytest.raises(AssertionError):
        pool.unpin([0])
    pool.reserve(h(3))
    assert pool.take_events() == []
    with pytest.raises(ValueError):
        HostPool(0)


def test_a_load_records_how_long_the_tier_kept_each_block():
    now = [100.0]
    pool = HostPool(4, clock=lambda: now[0])
    fill(pool, [h(1), h(2)])  # written at t=100
    now[0] = 130.0
    pool.unpin(pool.pin([h(1)]))  # read at t=130: kept 30 s
    now[0] = 190.0
    pool.unpin(pool.pin([h(1), h(2)]))  # h(1) last used at 130, h(2) written at 100
    assert list(pool.hit_ages) == [30.0, 60.0, 90.0]


def test_a_write_behind_pin_keeps_a_slot_without_making_it_a_use():
    pool = HostPool(2, clock=lambda: 5.0)
    fill(pool, [h(1), h(2)])
    slots = pool.pin_held([h(1), h(9)])
    assert slots == [0, None] and pool.is_pinned(0)  # h(9) is not held: nothing pinned for it
    assert pool.block_hashes() == [h(1), h(2)] and not pool.hit_ages  # no LRU move, no hit age: not a load
    assert pool.reserve(h(3)) == 1 and pool.lookup(h(1)) == 0  # h(1) is older but pinned: h(2) is evicted
    pool.commit([1])
    pool.unpin([0])
    assert pool.reserve(h(4)) == 0 and pool.lookup(h(1)) is None  # unpinned: evicted like any other
