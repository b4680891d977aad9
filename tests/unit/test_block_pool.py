"""Block pool and KV cache manager with exact block ids (as vLLM's tests/v1/core/test_prefix_caching.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from deepinfer.engine.block_pool import AllCleared, BlockPool, Removed, Stored
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.request import Request
from deepinfer.hashing import hash_blocks

BLOCK_SIZE = 4


@dataclass
class Params:
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


def make_request(request_id: str, prompt_token_ids: list[int], cache_salt: str = "") -> Request:
    request = Request(request_id, prompt_token_ids, Params(), cache_salt=cache_salt)
    request.bind_block_hashing(BLOCK_SIZE, b"fp")
    return request


def fake_hashes(*names: str) -> list[bytes]:
    return [name.encode().ljust(16, b"\x00") for name in names]


def test_fresh_pool_hands_out_blocks_in_order_and_never_block_0():
    pool = BlockPool(num_blocks=6)
    assert pool.num_free_blocks == 5
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 5]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    assert all(b.ref_cnt == 1 for b in pool.blocks[1:]) and pool.null_block.ref_cnt == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1)


def test_cached_blocks_evicted_lru_tail_of_a_sequence_first():
    pool = BlockPool(num_blocks=8)
    seq_a = pool.get_new_blocks(3)  # 1 2 3
    seq_b = pool.get_new_blocks(2)  # 4 5
    pool.cache_full_blocks(seq_a, fake_hashes("a0", "a1", "a2"), 0, 3)
    pool.cache_full_blocks(seq_b, fake_hashes("b0", "b1"), 0, 2)
    pool.take_events()

    pool.free_blocks(reversed(seq_a))
    pool.free_blocks(reversed(seq_b))
    # never-used blocks first, then A's (freed earlier) tail to head, then B's
    assert pool.free_block_queue.block_ids() == [6, 7, 3, 2, 1, 5, 4]

    # a hit on a free cached block takes it out of the middle; freeing it again puts it at the tail
    hit = pool.get_cached_block(fake_hashes("a1")[0])
    assert hit is not None and hit.block_id == 2
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.free_block_queue.block_ids() == [6, 7, 3, 1, 5, 4]
    pool.free_blocks([hit])
    assert pool.free_block_queue.block_ids() == [6, 7, 3, 1, 5, 4, 2]

    assert [b.block_id for b in pool.get_new_blocks(3)] == [6, 7, 3]
    assert pool.take_events() == [Removed(fake_hashes("a2"))]
    assert pool.get_cached_block(fake_hashes("a2")[0]) is None
    assert pool.get_cached_block(fake_hashes("a0")[0]).block_id == 1
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 5]
    assert pool.take_events() == [Removed(fake_hashes("a0", "b1"))]


def test_uncached_freed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(num_blocks=5)
    blocks = pool.get_new_blocks(4)  # 1 2 3 4
    pool.cache_full_blocks(blocks, fake_hashes("x0", "x1"), 0, 2)  # 3 and 4 stay uncached
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_queue.block_ids() == [3, 4, 2, 1]


def test_stored_events_only_for_newly_cached_hashes():
    pool = BlockPool(num_blocks=10)
    first = pool.get_new_blocks(3)
    second = pool.get_new_blocks(3)
    hashes = fake_hashes("h0", "h1", "h2")
    pool.cache_full_blocks(first, hashes, 0, 2)
    pool.cache_full_blocks(first, hashes, 2, 3)
    assert pool.take_events() == [Stored(hashes[:2], None), Stored(hashes[2:], hashes[1])]
    # the same content computed twice: the first block keeps the hash, the duplicate stays uncached
    pool.cache_full_blocks(second, hashes, 0, 3)
    assert pool.take_events() == []
    assert [b.block_hash for b in second] == [None, None, None]
    assert pool.get_cached_block(hashes[0]) is first[0]


def test_reset_prefix_cache():
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, fake_hashes("r0", "r1"), 0, 2)
    pool.take_events()
    assert pool.reset_prefix_cache() is False  # held blocks
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllCleared()]
    assert pool.get_cached_block(fake_hashes("r0")[0]) is None
    assert all(b.block_hash is None for b in pool.blocks)


def test_caching_disabled():
    pool = BlockPool(num_blocks=4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, fake_hashes("d0", "d1"), 0, 2)
    assert pool.get_cached_block(fake_hashes("d0")[0]) is None and pool.take_events() == []


def test_prefix_hit_shares_blocks_with_ref_counts():
    pool = BlockPool(num_blocks=10)
    kv = KVCacheManager(pool, BLOCK_SIZE)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    req_a = make_request("a", prompt)
    assert kv.get_computed_blocks(req_a) == ([], 0)
    assert [b.block_id for b in kv.allocate_slots(req_a, 10)] == [1, 2, 3]
    req_a.num_computed_tokens = 10
    kv.cache_blocks(req_a, 10)
    assert pool.take_events() == [Stored(hash_blocks(prompt, BLOCK_SIZE, b"fp", ""), None)]
    assert pool.blocks[3].block_hash is None  # partial last block is not cached

    req_b = make_request("b", prompt)
    hits, num_hit_tokens = kv.get_computed_blocks(req_b)
    assert [b.block_id for b in hits] == [1, 2] and num_hit_tokens == 8
    assert [b.block_id for b in kv.allocate_slots(req_b, 2, hits)] == [4]
    assert kv.get_block_ids(req_b) == [1, 2, 4]
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]

    # another tenant shares nothing
    req_c = make_request("c", prompt, cache_salt="other")
    assert kv.get_computed_blocks(req_c) == ([], 0)

    kv.free(req_a)
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    kv.free(req_b)
    assert pool.num_free_blocks == 9 and all(b.ref_cnt == 0 for b in pool.blocks)
    # b freed last, tail first: 4 (uncached) to the head; 2, 1 to the tail
    assert pool.free_block_queue.block_ids() == [4, 3, 5, 6, 7, 8, 9, 2, 1]


def test_full_prompt_hit_leaves_the_last_token_to_compute():
    pool = BlockPool(num_blocks=10)
    kv = KVCacheManager(pool, BLOCK_SIZE)
    prompt = list(range(8))  # exactly 2 full blocks
    req_a = make_request("a", prompt)
    kv.allocate_slots(req_a, 8)
    kv.cache_blocks(req_a, 8)
    req_b = make_request("b", prompt)
    hits, num_hit_tokens = kv.get_computed_blocks(req_b)
    assert [b.block_id for b in hits] == [1] and num_hit_tokens == 4


def test_allocate_slots_returns_none_and_changes_nothing_when_short():
    pool = BlockPool(num_blocks=5)  # 4 usable
    kv = KVCacheManager(pool, BLOCK_SIZE)
    prompt = list(range(12))
    req_a = make_request("a", prompt)
    kv.allocate_slots(req_a, 12)  # 1 2 3
    kv.cache_blocks(req_a, 12)
    kv.free(req_a)  # all cached and free
    req_b = make_request("b", prompt + [99] * 4)
    hits, num_hit_tokens = kv.get_computed_blocks(req_b)
    assert num_hit_tokens == 12
    # 3 hits are free blocks: taking them leaves 1 free block, the 4 new tokens need 1 → fits exactly
    assert [b.block_id for b in kv.allocate_slots(req_b, 4, hits)] == [4]
    assert kv.get_block_ids(req_b) == [1, 2, 3, 4] and pool.num_free_blocks == 0

    req_c = make_request("c", [7] * 5)
    assert kv.allocate_slots(req_c, 5) is None
    assert kv.get_block_ids(req_c) == [] and pool.num_free_blocks == 0
    # a 17th token needs a 5th block: refused, the block table is unchanged
    req_b.num_computed_tokens = 16
    assert kv.allocate_slots(req_b, 1) is None
    assert kv.get_block_ids(req_b) == [1, 2, 3, 4]
