"""Block tables of a hybrid model, one per KV group over one block pool: window freeing and bounded-replay hits.
No torch.

The hybrid counterpart of `KVCacheManager` (engine/kv_groups.py says what a group is). Each request holds one block
table per group, all the same length; a sliding-window group's table starts with null blocks where the window has
moved past (a query at p reads keys (p - W, p] only):

    block_size 4, W = 6, num_computed_tokens 14: the next query (14) reads keys 9..14
        tokens          0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 . .
        global group    b1      | b2      | b3        | b4            every block kept
        local group     null    | null    | b7        | b8            blocks before 9 // 4 = 2 freed

A freed local block keeps its cached hash (it sits in the free queue and is evicted in LRU order), so a later hit can
still use it. **Hits**: a hit at P tokens needs the full-attention groups' blocks for [0, P) and every local group's
blocks for the window before P, [P - W + 1, P) (`first_needed_token`). The longest global hit G is found first; P is
then searched downward from G: a local miss at block j inside P's window makes j the next candidate (every P between
them has j in its window too). The hit replays G - P tokens that the global groups had cached (counted in
`num_replayed_tokens`).

**Checkpoints** (`checkpoint_tokens` = N, a multiple of the block size): the blocks of the window before every
multiple of N are freed into the pool's protected queue, evicted only after every other free block; so while the
global blocks stay, a hit replays at most about N tokens, whatever the context length (vLLM keeps no such
checkpoints and replays up to the whole context when the window before the end was evicted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.engine.block_pool import BlockPool, KVCacheBlock
from deepinfer.engine.kv_groups import KVGroup, first_needed_token, group_block_hash
from deepinfer.engine.request import Request


@dataclass
class HybridHit:
    """A prefix hit of every group: `blocks[g]` is group g's table for the first `num_tokens` tokens (local groups:
    null blocks before the window), not referenced yet; `num_replay_tokens` the global hit's tokens past it."""

    blocks: list[list[KVCacheBlock]]
    num_tokens: int
    num_replay_tokens: int = 0

    @property
    def num_blocks(self) -> int:
        """Table entries per group (null ones included)."""
        return len(self.blocks[0])


class HybridKVCacheManager:
    """Maps each request to one block table per KV group; a step fits only when every group's new blocks fit."""

    def __init__(self, block_pool: BlockPool, block_size: int, groups: Sequence[KVGroup],
                 checkpoint_tokens: int | None = None) -> None:
        if checkpoint_tokens is not None and (checkpoint_tokens < block_size or checkpoint_tokens % block_size):
            raise ValueError(f"checkpoint_tokens must be a multiple of block_size={block_size}, got "
                             f"{checkpoint_tokens}")
        self.block_pool, self.block_size = block_pool, block_size
        self.groups = list(groups)
        self.checkpoint_tokens = checkpoint_tokens
        self._null = block_pool.null_block
        #: Per request, one table per group, all the same length; `req_to_blocks` holds group 0's (the same list
        #: objects: what the scheduler reads for a request's length in blocks).
        self.group_tables: dict[str, list[list[KVCacheBlock]]] = {}
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        #: Per request and group: leading blocks in the prefix cache, and (local groups) leading blocks freed.
        self.num_cached_blocks: dict[str, list[int]] = {}
        self.num_freed_blocks: dict[str, list[int]] = {}
        #: Tokens hits recomputed although the global groups held them (the replay of every admitted hit).
        self.num_replayed_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks the pool can hand out now."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.usage

    # -- hits ----------------------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[HybridHit, int]:
        """KVCacheManager's form of `find_hit`: the hit (for allocate_slots) and the tokens it covers."""
        hit = self.find_hit(request)
        return hit, hit.num_tokens

    def find_hit(self, request: Request) -> HybridHit:
        """The longest prefix every group can reuse (at least the last token is left to compute; none for a
        request owing prompt logprobs). Its blocks are not referenced yet: pass the hit to allocate_slots."""
        groups = range(len(self.groups))
        if not self.block_pool.enable_caching or request.needs_prompt_logits:
            return HybridHit([[] for _ in groups], 0)
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        num_global = self._global_hit(hashes)
        num_blocks = self._window_hit(hashes, num_global)
        tables = []
        for g, group in enumerate(self.groups):
            first = self._first_needed_block(num_blocks, group)
            tables.append([self._null] * first + [self._cached(hashes[i], g) for i in range(first, num_blocks)])
        return HybridHit(tables, num_blocks * self.block_size, (num_global - num_blocks) * self.block_size)

    def _cached(self, block_hash: bytes, group: int) -> KVCacheBlock | None:
        return self.block_pool.get_cached_block(group_block_hash(block_hash, group))

    def _global_hit(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks every full-attention group has cached (all of them for a model without one)."""
        full = [g for g, group in enumerate(self.groups) if not group.is_local]
        for i, block_hash in enumerate(hashes):
            if any(self._cached(block_hash, g) is None for g in full):
                return i
        return len(hashes)

    def _window_hit(self, hashes: Sequence[bytes], num_blocks: int) -> int:
        """The longest P <= num_blocks (in blocks) whose window every local group has cached."""
        local = [(g, group) for g, group in enumerate(self.groups) if group.is_local]
        while num_blocks > 0:
            missing = next((i for g, group in local
                            for i in range(num_blocks - 1, self._first_needed_block(num_blocks, group) - 1, -1)
                            if self._cached(hashes[i], g) is None), None)
            if missing is None:
                return num_blocks
            num_blocks = missing
        return 0

    def _first_needed_block(self, num_blocks: int, group: KVGroup) -> int:
        """The first block a query after `num_blocks` full blocks reads in this group (0 for a full group)."""
        if not group.is_local:
            return 0
        return first_needed_token(num_blocks * self.block_size, group.sliding_window) // self.block_size

    # -- allocation -----------------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       hit: HybridHit | None = None) -> list[list[KVCacheBlock]] | None:
        """Room for num_new_tokens more tokens in every group: the new blocks per group, or None (nothing changed)
        when the pool cannot give them all. `hit` (admission only, the request holding no block) is referenced
        here; its free blocks count against the free ones."""
        rid = request.request_id
        tables = self.group_tables.get(rid)
        hit_blocks = hit.blocks if hit is not None and hit.num_blocks else None
        assert hit_blocks is None or tables is None, "cache hits are only taken at admission"
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit_blocks else 0)
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        held = len(tables[0]) if tables else (hit.num_blocks if hit_blocks else 0)
        num_new = max(0, num_required - held)
        evictable = {id(b): b for table in hit_blocks or () for b in table if b is not self._null and not b.ref_cnt}
        if num_new * len(self.groups) > self.block_pool.num_free_blocks - len(evictable):
            return None
        if tables is None:
            tables = self.group_tables[rid] = [[] for _ in self.groups]
            self.req_to_blocks[rid] = tables[0]
            self.num_cached_blocks[rid] = [0] * len(self.groups)
            self.num_freed_blocks[rid] = [0] * len(self.groups)
        if hit_blocks:
            for g, blocks in enumerate(hit_blocks):
                first = self._first_needed_block(len(blocks), self.groups[g])
                self.block_pool.touch(blocks[first:])
                tables[g].extend(blocks)
                self.num_cached_blocks[rid][g] = len(blocks)
                self.num_freed_blocks[rid][g] = first
            self.num_replayed_tokens += hit.num_replay_tokens
        new = [self.block_pool.get_new_blocks(num_new) for _ in self.groups]
        for table, blocks in zip(tables, new, strict=True):
            table.extend(blocks)
        return new

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter every group's blocks that are full of computed tokens into the prefix cache (null blocks, freed
        after they were cached, are skipped), then free the local blocks no later query reads
        (`free_out_of_window`): the scheduler calls this whenever a block became full, so a local block goes at
        most a block's worth of steps after the window left it."""
        self._cache(request, num_computed_tokens)
        self.free_out_of_window(request, num_computed_tokens)

    def _cache(self, request: Request, num_computed_tokens: int) -> None:
        if not self.block_pool.enable_caching:
            return
        rid = request.request_id
        num_full = num_computed_tokens // self.block_size
        cached = self.num_cached_blocks[rid]
        for g, table in enumerate(self.group_tables[rid]):
            if num_full <= cached[g]:
                continue
            if g == 0:  # the request's own hashes: Stored events name their parents
                self.block_pool.cache_full_blocks(table, request.block_hashes, cached[g], num_full)
            else:
                start = max(cached[g], self.num_freed_blocks[rid][g])
                hashes = [group_block_hash(h, g) for h in request.block_hashes[start:num_full]]
                self.block_pool.cache_full_blocks(table[start:num_full], hashes, 0, len(hashes), group=g)
            cached[g] = num_full

    def free_out_of_window(self, request: Request, num_computed_tokens: int | None = None) -> int:
        """Free every local group's blocks that no query after `num_computed_tokens` (default: the request's)
        reads; cached ones stay cached (evictable); how many it freed."""
        rid = request.request_id
        tables, freed = self.group_tables.get(rid), self.num_freed_blocks.get(rid)
        if tables is None:
            return 0
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        count = 0
        for g, group in enumerate(self.groups):
            if not group.is_local:
                continue
            first_kept = first_needed_token(num_computed_tokens, group.sliding_window) // self.block_size
            if self.block_pool.enable_caching:  # never free a full block before it is cached
                first_kept = min(first_kept, self.num_cached_blocks[rid][g])
            for i in range(freed[g], first_kept):
                self._release(tables[g], i, group)
                count += 1
            freed[g] = max(freed[g], first_kept)
        return count

    def _release(self, table: list[KVCacheBlock], i: int, group: KVGroup) -> None:
        """Free table[i] (a checkpoint window's block into the protected queue) and leave a null block there."""
        block, table[i] = table[i], self._null
        if block is not self._null:
            self.block_pool.free_blocks((block,), protect=self._in_checkpoint_window(i, group))

    def _in_checkpoint_window(self, index: int, group: KVGroup) -> bool:
        """Whether block `index` of a local group lies in the window before a multiple of checkpoint_tokens (the
        blocks a hit there needs)."""
        n = self.checkpoint_tokens
        if n is None or not group.is_local:
            return False
        checkpoint = -(-(index + 1) * self.block_size // n) * n  # the first multiple of N after the block's start
        return first_needed_token(checkpoint, group.sliding_window) // self.block_size <= index

    # -- release ------------------------------------------------------------------------------------------------
    def free_tail(self, request: Request, num_tokens: int) -> int:
        """Drop every group's blocks past the first cdiv(num_tokens, block_size) (rejected drafts' blocks, never
        cached), tail first; how many it dropped."""
        tables = self.group_tables.get(request.request_id)
        num_kept = -(-num_tokens // self.block_size)
        if tables is None or len(tables[0]) <= num_kept:
            return 0
        num_dropped = (len(tables[0]) - num_kept) * len(tables)
        for table in tables:
            tail = table[num_kept:]
            del table[num_kept:]
            self.block_pool.free_blocks(b for b in reversed(tail) if b is not self._null)
        return num_dropped

    def free(self, request: Request) -> None:
        """Drop every block reference of the request, each table tail first (checkpoint windows protected)."""
        rid = request.request_id
        tables = self.group_tables.pop(rid, None)
        self.req_to_blocks.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self.num_freed_blocks.pop(rid, None)
        for table, group in zip(tables or [[] for _ in self.groups], self.groups, strict=True):
            for i in range(len(table) - 1, -1, -1):
                self._release(table, i, group)

    def detach(self, request: Request) -> list[KVCacheBlock]:
        """A prefill lease hands one block table to a decode worker: not for per-group tables yet."""
        raise NotImplementedError("KV by layer type (enable_hybrid_kv_cache) does not hand off KV yet: a prefill "
                                  "lease, the host tier and the store need the all-global layout")

    def get_block_ids(self, request: Request) -> list[list[int]]:
        """The request's block table of each group (0 = a freed block: never read)."""
        return [[b.block_id for b in table] for table in self.group_tables.get(request.request_id, ())]

    def block_ids_from(self, request_id: str, start: int) -> list[int]:
        """The ids of every group's blocks from logical block `start` on, interleaved as the runner keeps them
        (block i of group g at i * num_groups + g; a freed local block is 0)."""
        tables = self.group_tables.get(request_id, ())
        return [table[i].block_id for i in range(start, len(tables[0]) if tables else 0) for table in tables]

    def get_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Group 0's blocks (the scheduler's view of a request's length in blocks)."""
        return self.req_to_blocks.get(request.request_id, [])

    def num_held_blocks(self, request: Request) -> int:
        """Pool blocks the request holds across its groups (null blocks excluded)."""
        tables = self.group_tables.get(request.request_id, ())
        return sum(b is not self._null for table in tables for b in table)
