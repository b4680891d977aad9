"""Rendezvous placement of store blocks: deterministic, balanced, and stable when a shard joins or leaves (only
the blocks of that shard move); the shard set follows heartbeats and their lease."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from deepinfer.kvcache.client import ShardSet
from deepinfer.kvcache.rendezvous import group_by_shard, owner_shard
from deepinfer.protocol import KvStoreHeartbeat

BLOCKS = [hashlib.sha256(str(i).encode()).digest()[:16] for i in range(4000)]
SHARDS = ["0", "1", "2", "3"]


def owners(shards: list[str]) -> dict[bytes, str]:
    return {h: owner_shard(h, shards) for h in BLOCKS}


def test_every_client_computes_the_same_owner_whatever_the_order():
    assert owners(SHARDS) == owners(list(reversed(SHARDS)))
    assert owner_shard(BLOCKS[0], []) is None


def test_blocks_spread_evenly():
    counts = Counter(owners(SHARDS).values())
    assert set(counts) == set(SHARDS)
    assert all(800 <= n <= 1200 for n in counts.values()), counts  # 1000 each, give or take


def test_a_joining_shard_takes_only_blocks_that_move_to_it():
    before, after = owners(SHARDS), owners([*SHARDS, "4"])
    moved = [h for h in BLOCKS if before[h] != after[h]]
    assert all(after[h] == "4" for h in moved)
    assert 600 <= len(moved) <= 1000  # about a fifth


def test_a_leaving_shard_moves_only_its_own_blocks():
    before, after = owners(SHARDS), owners(["0", "1", "3"])
    moved = {h for h in BLOCKS if before[h] != after[h]}
    assert moved == {h for h in BLOCKS if before[h] == "2"}
    assert all(after[h] != "2" for h in BLOCKS)


def test_group_by_shard_keeps_indexes_in_order():
    groups = group_by_shard(BLOCKS[:50], SHARDS)
    assert sorted(i for idx in groups.values() for i in idx) == list(range(50))
    assert all(idx == sorted(idx) for idx in groups.values())
    assert all(owner_shard(BLOCKS[i], SHARDS) == shard for shard, idx in groups.items() for i in idx)
    assert group_by_shard(BLOCKS[:5], []) == {}


def beat(shard: str, *, draining: bool = False, address: str = "127.0.0.1:1") -> KvStoreHeartbeat:
    return KvStoreHeartbeat(shard=shard, data_plane_address=address, internal_address="", draining=draining, ts=0.0)


def test_shard_set_follows_heartbeats_lease_and_draining():
    now = [100.0]
    shards = ShardSet(lease_s=3.0, clock=lambda: now[0])
    shards.observe(beat("a"))
    shards.observe(beat("b", address="127.0.0.1:2"))
    assert sorted(shards.live()) == ["a", "b"]
    now[0] += 2.0
    shards.observe(beat("a"))
    now[0] += 2.0  # b silent for 4 s > lease
    assert sorted(shards.live()) == ["a"]
    shards.observe(beat("a", draining=True))
    assert shards.live() == {}
    shards.observe(beat("b", address="127.0.0.1:9"))
    assert shards.live()["b"].data_plane_address == "127.0.0.1:9"
    shards.forget("b")
    assert shards.live() == {}
    with pytest.raises(ValueError):
        ShardSet(lease_s=0)
