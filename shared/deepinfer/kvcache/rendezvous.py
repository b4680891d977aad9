"""Which store shard holds a block: rendezvous (highest-random-weight) hashing of its hash over the live shards.

Every client computes the same answer from the same shard set, with no coordination:

    weight(shard, block) = first 8 bytes of blake2b(block_hash, key=shard name) as an unsigned integer
    owner(block)         = the shard of highest weight (ties: the smaller name)

A shard that joins takes exactly the blocks whose new highest weight is its own (about 1/N of them); a shard
that leaves hands only its own blocks to their second-highest shard. Every other block stays where it was, so a
shard set change turns only the moved blocks into misses. Pure Python, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence


def shard_weight(shard: str, block_hash: bytes) -> int:
    """The weight of one (shard, block) pair: a 64-bit number, uniform over pairs."""
    digest = hashlib.blake2b(bytes(block_hash), digest_size=8, key=shard.encode("utf-8")[:64])
    return int.from_bytes(digest.digest(), "big")


def owner_shard(block_hash: bytes, shards: Iterable[str]) -> str | None:
    """The shard a block lives on among `shards` (None when there is none)."""
    best: tuple[int, str] | None = None
    for shard in shards:
        weight = shard_weight(shard, block_hash)
        if best is None or weight > best[0] or (weight == best[0] and shard < best[1]):
            best = (weight, shard)
    return None if best is None else best[1]


def group_by_shard(block_hashes: Sequence[bytes], shards: Iterable[str]) -> dict[str, list[int]]:
    """shard → the indexes (into block_hashes, ascending) of the blocks it owns; {} when there is no shard."""
    shard_list = sorted(set(shards))
    groups: dict[str, list[int]] = {}
    if not shard_list:
        return groups
    for index, block_hash in enumerate(block_hashes):
        owner = owner_shard(block_hash, shard_list)
        assert owner is not None
        groups.setdefault(owner, []).append(index)
    return groups
