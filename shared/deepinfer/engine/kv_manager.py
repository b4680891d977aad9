"""Per-request block tables over the block pool: prefix-cache lookup, slot allocation, caching, freeing. No torch."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.engine.block_pool import BlockPool, KVCacheBlock
from deepinfer.engine.request import Request


class KVCacheManager:
    """Maps each request to its list of blocks; the scheduler sees only block lists, token counts and None."""

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request already in the prefix cache (hit at admission or cached since).
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks the pool can hand out now."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request's full blocks, and the tokens it covers.

        Never the whole sequence: at least its last token is left to compute, so the step has logits to sample
        from; none for a request that owes its prompt logprobs (`Request.needs_prompt_logits`). The blocks are not
        referenced yet; pass them to allocate_slots in the same scheduling step.
        """
        if not self.block_pool.enable_caching or request.needs_prompt_logits:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Give the request room for num_new_tokens more tokens; the new blocks, or None when the pool is short.

        ```
        c = computed, h = prefix-cache hit, n = new token, . = free slot; block_size = 4

        running, request.num_computed_tokens = 6, num_new_tokens = 5:
            slots:  | c c c c | c c n n | n n n . |   num_required_blocks = cdiv(6 + 5, 4) = 3
            blocks: | held    | held    | new     |   num_new_blocks = 3 - 2 held = 1

        admission, 2 hit blocks, num_new_tokens = 3:
            slots:  | h h h h | h h h h | n n n . |   num_computed = 0 + 2 * 4 = 8
            blocks: | hit     | hit     | new     |   num_new_blocks = cdiv(8 + 3, 4) - 2 hits = 1
        ```
        new_computed_blocks (prefix-cache hits, only at admission, when the request holds no block) are
        referenced here; those sitting in the free queue count against the free blocks, since taking them makes
        them unavailable for eviction. Nothing changes when the answer is None.
        """
        request_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if not new_computed_blocks:  # the every-step case: a running request, usually no new block
            num_new_blocks = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(
                request_blocks
            )
            if num_new_blocks <= 0:
                return []
            if num_new_blocks > self.block_pool.num_free_blocks:
                if not request_blocks:
                    del self.req_to_blocks[request.request_id]
                return None
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            request_blocks.extend(new_blocks)
            return new_blocks
        assert not new_computed_blocks or not request_blocks, "cache hits are only taken at admission"
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(request_blocks) - len(new_computed_blocks))
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            if not request_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            request_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        request_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks that are full of computed tokens into the prefix cache."""
        num_full_blocks = num_computed_tokens // self.block_size
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= num_cached or not self.block_pool.enable_caching:
            return
        blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full_blocks)
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Drop all the request's block references, tail first (its tail is evicted before its head)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def detach(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request but keep its block references: the caller now owns them (a prefill lease)."""
        self.num_cached_blocks.pop(request.request_id, None)
        return self.req_to_blocks.pop(request.request_id, [])

    def get_block_ids(self, request: Request) -> list[int]:
        """The request's block table."""
        return [block.block_id for block in self.req_to_blocks.get(request.request_id, ())]

    def get_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The request's blocks, in sequence order."""
        return self.req_to_blocks.get(request.request_id, [])
