"""KvIndex: events in seq order, gaps, epochs, paged snapshots, worker and shard loss, the cap — exact holders."""

from __future__ import annotations

from deepinfer.protocol import KvEvent, KvEventBatch, KvEventKind, KvStoreEventBatch, KvTier, SnapshotPage
from services.scheduler.kv_index import KvIndex, PrefixMatch, SyncState


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def stored(*ids: int, tier: KvTier = KvTier.DEVICE) -> KvEvent:
    return KvEvent(event_kind=KvEventKind.STORED, block_hashes=[h(i) for i in ids], tier=tier)


def removed(*ids: int, tier: KvTier = KvTier.DEVICE) -> KvEvent:
    return KvEvent(event_kind=KvEventKind.REMOVED, block_hashes=[h(i) for i in ids], tier=tier)


def batch(worker: str, seq: int, *events: KvEvent, epoch: str = "e1") -> KvEventBatch:
    return KvEventBatch(worker_id=worker, seq=seq, events=list(events), ts=0.0, epoch=epoch)


def page(worker: str, seq: int, ids, cursor: int = 0, next_cursor: int | None = None, epoch: str = "e1"):
    return SnapshotPage(
        worker_id=worker, seq=seq, block_hashes=[h(i) for i in ids], cursor=cursor, next_cursor=next_cursor,
        epoch=epoch,
    )


def live(index: KvIndex, worker: str, ids=(), seq: int = 0, layout: str = "L", epoch: str = "e1") -> None:
    """Join `worker` and page a one-page snapshot holding `ids` at `seq`."""
    assert index.observe_worker(worker, layout, epoch) is True
    assert index.begin_snapshot(worker)
    assert index.apply_page(page(worker, seq, ids, epoch=epoch))
    assert index.end_snapshot(worker)


def test_a_joining_worker_owes_a_snapshot_and_its_events_wait_for_it():
    index = KvIndex()
    assert index.observe_worker("w1", "L", "e1") is True
    assert index.apply_batch(batch("w1", 3, stored(1, 2))) is False  # held: no snapshot yet
    assert index.holders("L", h(1)) == {}
    assert index.begin_snapshot("w1")
    assert index.apply_page(page("w1", 2, [7], next_cursor=1))
    assert index.apply_page(page("w1", 2, [8], cursor=1))
    assert index.end_snapshot("w1")
    assert index.sync_state("w1") is SyncState.LIVE
    # snapshot at seq 2 holds 7, 8; batch 3 (held) applies on top
    assert [b for b in (1, 2, 7, 8) if index.holders("L", h(b)) == {"w1": "device"}] == [1, 2, 7, 8]
    assert index.num_entries == 4
    assert index.observe_worker("w1", "L", "e1") is False


def test_events_apply_in_order_duplicates_ignored_removal_and_all_cleared():
    index = KvIndex()
    live(index, "w1")
    assert index.apply_batch(batch("w1", 1, stored(1, 2, 3))) is False
    assert index.apply_batch(batch("w1", 1, stored(9))) is False  # duplicate seq: ignored
    assert index.holders("L", h(9)) == {}
    assert index.apply_batch(batch("w1", 2, removed(2), stored(4, tier=KvTier.HOST))) is False
    assert index.holders("L", h(2)) == {}
    assert index.holders("L", h(4)) == {"w1": "lower"}
    assert index.num_entries == 3
    assert index.apply_batch(batch("w1", 3, KvEvent(event_kind=KvEventKind.ALL_CLEARED))) is False
    assert index.holders("L", h(1)) == {} and index.holders("L", h(4)) == {"w1": "lower"}  # device tier only
    assert index.num_entries == 1 and index.num_blocks() == 1


def test_a_gap_drops_the_workers_entries_and_asks_for_a_snapshot():
    index = KvIndex()
    live(index, "w1", [1])
    live(index, "w2", [1])
    assert index.apply_batch(batch("w1", 2, stored(5))) is True  # seq 1 lost
    assert index.num_gaps == 1
    assert index.sync_state("w1") is SyncState.NEEDS_SNAPSHOT
    assert index.holders("L", h(1)) == {"w2": "device"}
    assert index.holders("L", h(5)) == {}
    assert index.begin_snapshot("w1")
    assert index.apply_page(page("w1", 2, [1, 5]))
    assert index.apply_batch(batch("w1", 3, stored(6))) is False  # held during paging
    assert index.end_snapshot("w1")
    assert index.holders("L", h(6)) == {"w1": "device"}
    assert index.holders("L", h(1)) == {"w1": "device", "w2": "device"}


def test_held_batches_with_a_gap_past_the_snapshot_ask_again():
    index = KvIndex()
    index.observe_worker("w1", "L", "e1")
    index.begin_snapshot("w1")
    index.apply_batch(batch("w1", 4, stored(6)))
    assert index.apply_page(page("w1", 2, [1]))
    assert index.end_snapshot("w1") is False  # seq 3 missing
    assert index.sync_state("w1") is SyncState.NEEDS_SNAPSHOT
    assert index.num_entries == 0


def test_a_page_of_another_snapshot_is_refused():
    index = KvIndex()
    index.observe_worker("w1", "L", "e1")
    index.begin_snapshot("w1")
    assert index.apply_page(page("w1", 2, [1], cursor=1)) is False  # not from the start
    assert index.apply_page(page("w1", 2, [1], next_cursor=1))
    assert index.apply_page(page("w1", 3, [2], cursor=1)) is False  # the worker cut a new snapshot
    assert index.apply_page(page("w1", 2, [2], cursor=1, epoch="e2")) is False


def test_a_new_epoch_is_a_restart_not_a_gap():
    index = KvIndex()
    live(index, "w1", [1], seq=5)
    assert index.apply_batch(batch("w1", 1, stored(2), epoch="e2")) is True
    assert (index.num_gaps, index.num_epochs) == (0, 1)
    assert index.holders("L", h(1)) == {}
    # the restarted worker's heartbeat agrees: nothing more to drop, the snapshot is still owed
    assert index.observe_worker("w1", "L", "e2") is True
    assert index.begin_snapshot("w1")
    assert index.apply_page(page("w1", 1, [2], epoch="e2"))
    assert index.end_snapshot("w1")
    assert index.holders("L", h(2)) == {"w1": "device"}
    # a heartbeat with a new epoch (a restart with no events yet) drops the entries too
    assert index.observe_worker("w1", "L", "e3") is True
    assert index.holders("L", h(2)) == {} and index.num_entries == 0


def test_a_worker_that_leaves_is_removed_with_its_entries_and_its_slot_reused():
    index = KvIndex()
    live(index, "w1", [1, 2])
    live(index, "w2", [2])
    index.remove_worker("w1")
    assert index.holders("L", h(1)) == {}
    assert index.holders("L", h(2)) == {"w2": "device"}
    assert index.num_entries == 1 and index.num_blocks() == 1
    assert index.apply_batch(batch("w1", 1, stored(3))) is False  # gone: ignored
    live(index, "w3", [4])
    assert index.holders("L", h(4)) == {"w3": "device"}
    assert index.holders("L", h(1)) == {}


def test_store_batches_gap_drops_the_shard_and_loss_removes_it():
    index = KvIndex()

    def store_batch(seq, stored_ids=(), evicted=(), layout="L"):
        return KvStoreEventBatch(
            shard="s0", seq=seq, layout_id=layout, stored_block_hashes=[h(i) for i in stored_ids],
            evicted_block_hashes=[h(i) for i in evicted], ts=0.0,
        )

    index.apply_store_batch(store_batch(1, [1, 2]))
    index.apply_store_batch(store_batch(2, [3], layout="M"))
    index.apply_store_batch(store_batch(3, evicted=[2]))
    assert index.holders("L", h(1)) == {"store:s0:L": "lower"}
    assert index.holders("L", h(2)) == {}
    assert index.holders("M", h(3)) == {"store:s0:M": "lower"}
    index.apply_store_batch(store_batch(5, [4]))  # seq 4 lost
    assert index.num_gaps == 1
    assert index.holders("L", h(1)) == {} and index.holders("M", h(3)) == {}
    assert index.holders("L", h(4)) == {"store:s0:L": "lower"}
    index.remove_store_shard("s0")
    assert index.num_entries == 0 and index.num_blocks() == 0


def test_match_walks_the_prefix_per_worker_with_tiers_and_the_store():
    index = KvIndex()
    live(index, "w1", [1, 2])
    live(index, "w2", [1])
    index.apply_batch(batch("w2", 1, stored(2, tier=KvTier.HOST)))
    index.apply_store_batch(KvStoreEventBatch(shard="s0", seq=1, layout_id="L", stored_block_hashes=[h(3)], ts=0.0))
    index.observe_worker("w3", "L", "e1")  # no snapshot yet: only the store counts
    live(index, "w4", [1, 2, 3], layout="M")  # another layout
    found = index.match("L", [h(1), h(2), h(3), h(4)], ["w1", "w2", "w3", "w4", "w5"])
    assert found == {
        "w1": PrefixMatch(device_blocks=2, store_blocks=1),
        "w2": PrefixMatch(device_blocks=1, lower_blocks=1, store_blocks=1),
        "w3": PrefixMatch(),  # the store has block 3, not the prefix's first
        "w4": PrefixMatch(),
        "w5": PrefixMatch(),
    }
    assert index.match("L", [h(3), h(1)], ["w1", "w3"]) == {
        "w1": PrefixMatch(store_blocks=1, device_blocks=1), "w3": PrefixMatch(store_blocks=1)
    }
    # a prefix ends at the first block nobody holds, even if later blocks are cached
    assert index.match("L", [h(9), h(1)], ["w1"]) == {"w1": PrefixMatch()}


def test_the_cap_evicts_the_least_recent_block_of_the_largest_holder():
    index = KvIndex(max_entries=4)
    live(index, "w1", [1, 2, 3])
    live(index, "w2", [1])
    index.touch("w1", [h(1)])  # credited by a decision: w1's 1 becomes its most recent
    index.apply_batch(batch("w2", 1, stored(5)))  # 5th entry: w1 (3 entries) loses its least recent, block 2
    assert index.num_entries == 4 and index.num_evicted == 1
    assert index.holders("L", h(2)) == {}
    assert index.holders("L", h(1)) == {"w1": "device", "w2": "device"}
    index.apply_batch(batch("w2", 2, stored(6)))  # now w2 is the largest (3): its least recent, block 1
    assert index.holders("L", h(1)) == {"w1": "device"}
    assert index.num_entries == 4 and index.num_evicted == 2


def test_a_snapshot_page_of_host_tier_blocks_indexes_them_in_the_lower_tier():
    index = KvIndex()
    assert index.observe_worker("w1", "L", "e1")
    assert index.begin_snapshot("w1")
    assert index.apply_page(SnapshotPage(worker_id="w1", seq=4, block_hashes=[h(1)], host_block_hashes=[h(1), h(2)],
                                         epoch="e1"))
    assert index.end_snapshot("w1")
    assert index.match("L", [h(1), h(2), h(3)], ["w1"]) == {"w1": PrefixMatch(device_blocks=1, lower_blocks=1)}
    index.apply_batch(batch("w1", 5, removed(2, tier=KvTier.HOST)))  # the host tier evicted it
    assert index.match("L", [h(1), h(2)], ["w1"]) == {"w1": PrefixMatch(device_blocks=1)}
