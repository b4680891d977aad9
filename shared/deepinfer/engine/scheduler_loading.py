"""The scheduler's loading state (a mixin of Scheduler; no torch): a request holds its blocks in WAITING_FOR_REMOTE_KVS
while their KV arrives from a lower tier (the host tier or the kvcache store), never scheduled meanwhile (the others
run), then runs from its first token not loaded, or goes back to the queue to be recomputed.

    new request ────────────────┐
    preempted, head of queue ───┴─ add_loading_request ─► loading ─┬ finish_loading(loaded=True) ─► running
      (Scheduler.resume_loader: the host tier)                     └ finish_loading(loaded=False) ─► queue, its
                                                                     new blocks dropped unused: recomputed

A resumed request keeps the usage of its admission (cached tokens by tier, first scheduled time): its prompt was
served once; what a resume reloads or recomputes is the engine's business, not the client's.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.request import Request, RequestStatus


class LoadingRequests:
    """add_loading_request / finish_loading over the Scheduler's queues (which also gives _register, _num_seqs)."""

    config: EngineConfig
    kv_manager: KVCacheManager
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    #: Requests holding blocks while their KV loads (never scheduled meanwhile).
    loading: dict[str, Request]
    num_added: int
    _arrival_key: dict[str, tuple[float, int]]

    def add_loading_request(self, request: Request, num_stored_blocks: int) -> tuple[int, list[int]] | None:
        """Hold a new request (or a preempted one, taken from the queue) whose first `num_stored_blocks` full blocks
        are in a lower tier: device hits reused, blocks allocated for the stored ones past them. (index of the first
        block to load, block ids to fill); None: nothing to load or no room, nothing changed (queue a new one);
        also None with KV groups (not loaded per group yet: the request is recomputed)."""
        if self.config.kv_groups:
            return None
        request.bind_block_hashing(self.config.block_size, self.config.model_fingerprint)
        computed_blocks, num_hit_tokens = self.kv_manager.get_computed_blocks(request)
        max_blocks = min(num_stored_blocks, (request.num_tokens - 1) // self.config.block_size)
        num_load_blocks = max_blocks - len(computed_blocks)
        if num_load_blocks <= 0 or self._num_seqs() >= self.config.max_num_seqs:
            return None
        resuming = request.status is RequestStatus.PREEMPTED
        if not resuming:
            self._register(request)
        new = self.kv_manager.allocate_slots(request, num_load_blocks * self.config.block_size, computed_blocks)
        if new is None:
            if not resuming:
                del self.requests[request.request_id], self._arrival_key[request.request_id]
            return None
        if resuming:
            self.waiting.remove(request)
        else:
            request.num_cached_tokens = num_hit_tokens
            self.num_added += 1
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request
        return len(computed_blocks), [block.block_id for block in new]

    def finish_loading(self, request_id: str, loaded: bool, num_host_blocks: int = 0) -> None:
        """`loaded`: the blocks hold the loaded KV (`num_host_blocks` of them from the host tier, the rest from the
        store), cached now, and the request runs from its first token not loaded; else the new blocks are dropped
        unused and it waits to be recomputed. Ignored for an aborted request."""
        request = self.loading.pop(request_id, None)
        if request is None:
            return
        resumed = request.num_preemptions > 0
        if not loaded:
            self.kv_manager.free(request)
            if resumed:
                request.status = RequestStatus.PREEMPTED
            else:
                request.status, request.num_cached_tokens = RequestStatus.WAITING, 0
            key = self._arrival_key[request_id]
            position = sum(1 for r in self.waiting if self._arrival_key[r.request_id] < key)
            self.waiting.insert(position, request)
            return
        num_loaded = len(self.kv_manager.get_blocks(request)) * self.config.block_size
        if not resumed:
            request.num_host_cached_tokens = num_host_blocks * self.config.block_size
            request.num_store_cached_tokens = num_loaded - request.num_cached_tokens - request.num_host_cached_tokens
            request.num_cached_tokens = num_loaded
            request.first_scheduled_time = time.monotonic()
        request.num_computed_tokens = num_loaded
        self.kv_manager.cache_blocks(request, num_loaded)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: self._arrival_key[r.request_id])
