"""KV groups and the hybrid block accounting, step by step with exact block ids (issue #33's milestone 2)."""

from __future__ import annotations

import pytest

from deepinfer.engine.block_pool import BlockPool, Removed, Stored
from deepinfer.engine.hybrid_kv_manager import HybridKVCacheManager
from deepinfer.engine.kv_groups import KVGroup, first_needed_token, group_block_hash, kv_groups
from tests.unit.test_block_pool import BLOCK_SIZE, make_request

W = 6  # window: a query at p reads keys p-5..p
GLOBAL, LOCAL = KVGroup((0,)), KVGroup((1,), W)


def manager(num_blocks: int, groups=(GLOBAL, LOCAL), checkpoint_tokens=None) -> HybridKVCacheManager:
    return HybridKVCacheManager(BlockPool(num_blocks), BLOCK_SIZE, groups, checkpoint_tokens)


def compute(kv: HybridKVCacheManager, request, num_tokens: int) -> list[list[int]] | None:
    """One step of num_tokens for the request, as the scheduler runs it: allocate, compute, cache, free the window."""
    if kv.allocate_slots(request, num_tokens) is None:
        return None
    request.num_computed_tokens += num_tokens
    kv.cache_blocks(request, request.num_computed_tokens)  # caches, then frees what left the window
    return kv.get_block_ids(request)


def admit(kv: HybridKVCacheManager, request, num_tokens: int):
    """Admission with the prefix cache: the hit, then the rest of num_tokens computed in one step."""
    hit, num_hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, num_tokens - num_hit_tokens, hit) is not None
    request.num_computed_tokens = num_tokens
    kv.cache_blocks(request, num_tokens)
    return hit


def test_groups_split_layers_by_type_in_equal_groups_full_attention_first():
    gemma_270m = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = kv_groups(gemma_270m)
    assert [g.layers for g in groups] == [(5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert [g.sliding_window for g in groups] == [None] + [512] * 5
    gemma_1b = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    assert [len(g.layers) for g in kv_groups(gemma_1b)] == [2] * 13  # gcd(22 local, 4 global) = 2
    assert kv_groups([None] * 4) == [KVGroup((0, 1, 2, 3))]
    assert kv_groups([4096] * 3) == [KVGroup((0, 1, 2), 4096)]  # Mistral: one local group
    with pytest.raises(ValueError):
        kv_groups([0, None])
    assert group_block_hash(b"h", 0) == b"h" and group_block_hash(b"h", 1) != group_block_hash(b"h", 2)
    assert first_needed_token(14, 6) == 9 and first_needed_token(3, 6) == 0


def test_local_blocks_are_freed_as_the_window_moves():
    kv = manager(num_blocks=20)
    request = make_request("a", list(range(100, 140)))
    assert compute(kv, request, 14) == [[1, 2, 3, 4], [0, 0, 7, 8]]  # next query 14 reads 9..14: blocks 2, 3
    assert kv.block_pool.num_free_blocks == 19 - 6
    assert compute(kv, request, 1) == [[1, 2, 3, 4], [0, 0, 7, 8]]  # 15 reads 10..15: still blocks 2, 3
    assert compute(kv, request, 2) == [[1, 2, 3, 4, 9], [0, 0, 0, 8, 10]]  # 17 reads 12..17: blocks 3, 4
    assert kv.num_held_blocks(request) == 5 + 2
    # The freed local blocks stay cached (evictable) under their group's key: 2 at positions 0..7, then 7.
    local_keys = [group_block_hash(h, 1) for h in request.block_hashes[:3]]
    assert [kv.block_pool.get_cached_block(k).block_id for k in local_keys] == [5, 6, 7]
    kv.free(request)
    assert kv.block_pool.num_free_blocks == 19 and kv.group_tables == kv.req_to_blocks == {}


def test_a_long_chunk_holds_every_local_block_until_the_step_is_computed():
    kv = manager(num_blocks=20)
    request = make_request("a", list(range(100, 140)))
    assert kv.allocate_slots(request, 16) is not None  # the chunk's queries read keys from its first block on
    assert kv.get_block_ids(request) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    request.num_computed_tokens = 16
    kv._cache(request, 16)
    assert kv.free_out_of_window(request) == 2  # 16 reads 11..16: blocks 2 and 3 of the local group
    assert kv.get_block_ids(request) == [[1, 2, 3, 4], [0, 0, 7, 8]]


def test_allocation_fits_only_when_every_group_fits_and_changes_nothing_otherwise():
    kv = manager(num_blocks=6)  # 5 usable blocks
    request = make_request("a", list(range(100, 140)))
    assert kv.allocate_slots(request, 12) is None  # 3 blocks in each of 2 groups
    assert kv.group_tables == {} and kv.block_pool.num_free_blocks == 5
    assert kv.allocate_slots(request, 8) is not None
    assert kv.get_block_ids(request) == [[1, 2], [3, 4]]


def test_a_hit_takes_global_blocks_for_the_prefix_and_local_blocks_for_its_window():
    kv = manager(num_blocks=30)
    first = make_request("a", list(range(100, 124)))
    admit(kv, first, 24)
    kv.free(first)
    again = make_request("b", list(range(100, 124)) + [7, 7, 7])  # the same 24 tokens, one more turn
    hit = kv.find_hit(again)
    # 6 full blocks cached; a hit at 24 needs the local window 19..23: blocks 4 and 5.
    assert hit.num_tokens == 24 and hit.num_replay_tokens == 0
    assert [b.block_id for b in hit.blocks[0]] == [1, 2, 3, 4, 5, 6]
    assert [b.block_id for b in hit.blocks[1]] == [0, 0, 0, 0, 11, 12]
    assert kv.allocate_slots(again, 3, hit) is not None
    assert kv.get_block_ids(again) == [[1, 2, 3, 4, 5, 6, 13], [0, 0, 0, 0, 11, 12, 14]]
    assert kv.num_replayed_tokens == 0


def test_a_hit_whose_window_was_evicted_replays_from_an_earlier_window():
    kv = manager(num_blocks=30)
    first = make_request("a", list(range(100, 124)))
    admit(kv, first, 24)
    kv.free(first)
    pool = kv.block_pool
    evicted = pool.get_cached_block(group_block_hash(first.block_hashes[4], 1))  # the local block of 16..19
    pool.touch([evicted])
    pool.free_blocks([evicted])  # now at the tail ...
    pool.free_block_queue.remove(evicted)
    pool.free_block_queue.appendleft(evicted)  # ... moved to the head: the next block handed out
    pool.get_new_blocks(1)
    hit = kv.find_hit(make_request("b", list(range(100, 124)) + [7]))
    # P = 24 and 20 both need block 4 (16..19) in their window; P = 16 reads 11..15: blocks 2, 3 (cached).
    assert hit.num_tokens == 16 and hit.num_replay_tokens == 8
    assert [b.block_id for b in hit.blocks[1]] == [0, 0, 9, 10]


def test_checkpoint_windows_are_evicted_last_so_a_hit_replays_at_most_n_tokens():
    kv = manager(num_blocks=26, checkpoint_tokens=16)
    first = make_request("a", list(range(100, 140)))
    admit(kv, first, 40)  # frees the local blocks 0..7 (query 40 reads 35..39: blocks 8, 9)
    kv.free(first)
    pool = kv.block_pool
    local = [pool.get_cached_block(group_block_hash(h, 1)) for h in first.block_hashes[:10]]
    # The windows before 16 (11..15: blocks 2, 3) and 32 (27..31: blocks 6, 7) are protected.
    assert [i for i, b in enumerate(local) if b.protected] == [2, 3, 6, 7]
    assert pool.protected_queue.num_free_blocks == 4
    # 25 usable blocks: 5 never used, 16 cached in LRU order (local 0 1 4 5, global 9..0, local 9 8), 4 protected.
    # Another request's 7 blocks a group take the 5 unused and evict 9: local 0 1 4 5 and global 9..5.
    other = make_request("c", list(range(500, 528)))
    assert kv.allocate_slots(other, 28) is not None
    assert all(b.block_hash is not None for b in (local[2], local[3], local[6], local[7]))
    hit = kv.find_hit(make_request("b", list(range(100, 140)) + [7]))
    # The global hit is 5 blocks (20 tokens); its window needs local block 4 (evicted): the hit is the checkpoint
    # at 16, replaying 4 tokens.
    assert hit.num_tokens == 16 and hit.num_replay_tokens == 4
    assert [b.block_id for b in hit.blocks[1]] == [0, 0, local[2].block_id, local[3].block_id]
    kv.free(other)


def test_only_group_0_blocks_make_kv_events():
    kv = manager(num_blocks=30)
    request = make_request("a", list(range(100, 124)))
    admit(kv, request, 24)
    stored = [h for e in kv.block_pool.take_events() if isinstance(e, Stored) for h in e.block_hashes]
    assert stored == request.block_hashes[:6]
    kv.free(request)
    kv.block_pool.get_new_blocks(kv.block_pool.num_free_blocks)  # evict everything
    removed = {h for e in kv.block_pool.take_events() if isinstance(e, Removed) for h in e.block_hashes}
    assert removed == set(request.block_hashes[:6])


def test_rejected_drafts_free_every_groups_tail():
    kv = manager(num_blocks=30)
    request = make_request("a", list(range(100, 124)))
    compute(kv, request, 10)
    assert kv.allocate_slots(request, 7) is not None  # a verify step: 1 token + 6 drafts (to 17)
    assert [len(t) for t in kv.get_block_ids(request)] == [5, 5]
    assert kv.free_tail(request, 12) == 4  # 2 accepted: 12 tokens, 3 blocks a group
    assert kv.get_block_ids(request) == [[1, 2, 3], [0, 5, 6]]  # the local group's first block (4) went at 10
    kv.free(request)
    assert kv.block_pool.num_free_blocks == 29


def test_a_plain_model_group_matches_the_single_table_manager():
    kv = manager(num_blocks=12, groups=(KVGroup((0, 1)),))
    request = make_request("a", list(range(100, 120)))
    assert compute(kv, request, 10) == [[1, 2, 3]]
    kv.free(request)
    again = make_request("b", list(range(100, 120)))
    hit = kv.find_hit(again)
    assert hit.num_tokens == 8 and [b.block_id for b in hit.blocks[0]] == [1, 2]


def test_checkpoint_tokens_must_be_a_multiple_of_the_block_size():
    with pytest.raises(ValueError, match="multiple of block_size"):
        manager(num_blocks=8, checkpoint_tokens=6)
