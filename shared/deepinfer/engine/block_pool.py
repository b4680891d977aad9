"""Ref-counted KV blocks, the prefix cache (block hash → block) and the LRU free queue. No torch.

Block 0 is the reserved null block: it is never handed out, never freed and never cached, so a block table can be
padded with 0 and a slot of -1 means padding (the runner writes nothing there).

Free queue order (head = next to be reused):

    head → [never used / uncached] ... [cached, least recently freed] ... [cached, most recently freed] ← tail

A freed block that holds no hash is worthless and goes to the head; a cached one goes to the tail, so cached
blocks are evicted last and in LRU order. Callers free a sequence's blocks in reverse order so its tail blocks
(least likely to be shared) are evicted before its head.

A cached block freed with `protected` set (a hybrid model's checkpoint window, engine/hybrid_kv_manager.py) waits in
a second queue that is drawn from only once the first is empty: it is evicted after every other free block.

Blocks of a KV group other than 0 (engine/kv_groups.py) are cached under group-tagged hashes that no one outside
this pool knows: they enter no Stored/Removed event and no `newly_cached` list.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: The reserved padding block; block tables are padded with it.
NULL_BLOCK_ID = 0


@dataclass(eq=False)
class KVCacheBlock:
    """One block of block_size token slots; block_hash is set while the block is in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    #: The KV group whose layers the block holds while it is cached (engine/kv_groups.py; 0 for a plain model).
    group: int = 0
    #: Freed into the protected queue (evicted last) while cached.
    protected: bool = False
    # Links of the free queue; None while the block is not in it (a block is in it iff ref_cnt == 0).
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


#: The device pool's tier name; the worker's host-memory pool (engine/host_pool.py) reports "host".
DEVICE_TIER = "device"


@dataclass
class Stored:
    """Blocks entered the prefix cache; block_hashes form a chain whose first parent is parent_hash."""

    block_hashes: list[bytes]
    parent_hash: bytes | None
    tier: str = DEVICE_TIER


@dataclass
class Removed:
    """Blocks left the prefix cache (evicted for reuse)."""

    block_hashes: list[bytes]
    tier: str = DEVICE_TIER


@dataclass
class AllCleared:
    """The whole prefix cache was dropped."""


#: What the block pool reports about its prefix cache (services turn these into KvEventBatch messages).
KvCacheEvent = Stored | Removed | AllCleared


class FreeBlockQueue:
    """Doubly-linked list of free blocks: pop from the head, push at either end, remove from the middle, all O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks at the ends
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Take the block at the head."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free, next_block.prev_free = next_block, prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block at the head (reused first)."""
        self._link(block, self._head, self._head.next_free)

    def _link(self, block: KVCacheBlock, prev_block, next_block) -> None:
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} already free"
        block.prev_free, block.next_free = prev_block, next_block
        prev_block.next_free = next_block.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head to tail (for tests and debugging)."""
        ids, block = [], self._head.next_free
        while block is not self._tail and block is not None:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """All KV blocks of a worker: allocation, ref counts, the prefix cache and its event buffer."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_kv_events: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        #: Free cached blocks freed with `protected` set: evicted after every block of free_block_queue.
        self.protected_queue = FreeBlockQueue(())
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self._events: list[KvCacheEvent] = []
        #: True = remember each block entering the prefix cache in `newly_cached` (the host tier's write-through
        #: takes them after every step).
        self.track_cached = False
        self.newly_cached: list[tuple[KVCacheBlock, bytes]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return self.free_block_queue.num_free_blocks + self.protected_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (block 0 excluded) held by requests."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block holding this hash, if cached."""
        if not self.enable_caching:
            return None
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        request_blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: int = 0,
    ) -> None:
        """Register request_blocks[num_cached_blocks:num_full_blocks] under their hashes and emit Stored (group 0:
        other groups' blocks, under group-tagged hashes, are cached silently).

        A hash already held by another block (two requests computed the same block) keeps that block; this one
        stays uncached and is reused first once freed. Stored lists only newly cached hashes, one event per
        contiguous run, so every stored hash is later matched by exactly one Removed (or AllCleared).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        run: list[bytes] = []
        run_parent: bytes | None = None
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = request_blocks[i], block_hashes[i]
            if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
                block.block_hash, block.group = block_hash, group
                self.cached_block_hash_to_block[block_hash] = block
                if group:
                    continue
                if self.track_cached:
                    self.newly_cached.append((block, block_hash))
                if not run:
                    run_parent = block_hashes[i - 1] if i > 0 else None
                run.append(block_hash)
            elif run:
                self._emit(Stored(run, run_parent))
                run = []
        if run:
            self._emit(Stored(run, run_parent))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take num_blocks from the head of the free queue (ref_cnt 1), evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks, evicted = [], []
        for _ in range(num_blocks):
            if self.free_block_queue.num_free_blocks:
                block = self.free_block_queue.popleft()
            else:
                block = self.protected_queue.popleft()
                block.protected = False
            if block.block_hash is not None:
                if not block.group:
                    evicted.append(block.block_hash)
                del self.cached_block_hash_to_block[block.block_hash]
                block.block_hash, block.group = None, 0
            block.ref_cnt = 1
            blocks.append(block)
        if evicted:
            self._emit(Removed(evicted))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (cached) blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if block.protected:
                    self.protected_queue.remove(block)
                    block.protected = False
                else:
                    self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], protect: bool = False) -> None:
        """Drop a reference on each block; those reaching 0 are queued in the given order (first = evicted first);
        `protect`: cached ones into the protected queue (evicted after every other free block)."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0 and block is not self.null_block, (
                f"double free of block {block.block_id}"
            )
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self.free_block_queue.appendleft(block)
            elif protect:
                block.protected = True
                self.protected_queue.append(block)
            else:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (emits AllCleared); refused (False) while any block is held by a request."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash, block.group = None, 0
        while self.protected_queue.num_free_blocks:  # worthless now: reused first, like any uncached block
            block = self.protected_queue.popleft()
            block.protected = False
            self.free_block_queue.appendleft(block)
        self.cached_block_hash_to_block.clear()
        self.newly_cached.clear()
        self._emit(AllCleared())
        return True

    def take_events(self) -> list[KvCacheEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _emit(self, event: KvCacheEvent) -> None:
        if self.enable_kv_events:
            self._events.append(event)
