"""Continuous batching with chunked prefill, prefix caching and preemption by recompute. No torch.

One step, one token budget (max_num_batched_tokens), spent in this order:

    1. running decodes         1 token each                      (decode-first: inter-token latency holds),
                               + its draft tokens when it has some (speculative decoding: `_schedule_drafts`)
    2. running prefills        the next chunk each               (min(remaining, budget, threshold))
    3. waiting requests, FCFS  prefix-cache lookup, then a chunk (only in a step that preempted nobody)

When the pool is out of blocks for a running request, the most recently arrived running request is preempted
by recompute — blocks freed, num_computed_tokens reset, back to the FRONT of the waiting queue with its output
tokens kept — until the allocation fits or the request preempts itself. Its full blocks stay in the prefix
cache, so resuming usually recomputes only what was evicted meanwhile.

n > 1: add one Request per sequence with the same prompt. A sibling shares a block once the first request has
computed it (blocks enter the prefix cache in update()); siblings admitted in the same step share nothing yet.

Store and host-tier loads: add_loading_request holds a request's blocks in WAITING_FOR_REMOTE_KVS (never scheduled;
others run); finish_loading runs it from its first unloaded token, or queues it to recompute. Loading requests count
in max_num_seqs. A preempted request at the head of the queue is first offered to resume_loader (the host tier).

The engine loop: `out = scheduler.schedule(); sampled = runner.execute(out); updates = scheduler.update(out, sampled)`.
abort_requests() is called between steps, never between schedule() and the runner's execute().
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from deepinfer.engine.admission_window import AdmissionWindow
from deepinfer.engine.block_pool import BlockPool, KVCacheBlock, KvCacheEvent
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.errors import ContextLengthExceeded
from deepinfer.engine.hybrid_kv_manager import HybridKVCacheManager
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.outputs import EngineOutput, SampledToken
from deepinfer.engine.request import (
    Request,
    RequestStatus,
    append_sampled_token,
    check_stop,
    hand_out_prompt_logprobs,
)
from deepinfer.engine.scheduler_loading import LoadingRequests
from deepinfer.engine.scheduler_output import RequestUpdate, ScheduledRequest, SchedulerOutput
from deepinfer.protocol import FinishReason

#: What KV by layer type (EngineConfig.kv_groups) cannot do yet, said where a request asks for it.
HYBRID_NO_HANDOFF = ("KV by layer type (enable_hybrid_kv_cache) cannot hand KV to or from another worker or tier yet "
                     "(a prefill lease, a prefilled request, a host-tier or store load)")


class _Step:
    """Bookkeeping of one schedule() call: the budget left and the requests taken so far."""

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        # request_id → (request, num_new_tokens), in scheduling order
        self.entries: dict[str, tuple[Request, int]] = {}
        self.preempted_request_ids: list[str] = []
        #: request_id → the draft tokens its entry feeds after its last token (speculative decoding)
        self.draft_token_ids: dict[str, Sequence[int]] = {}

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.entries[request.request_id] = (request, num_new_tokens)
        self.token_budget -= num_new_tokens

    def drop(self, request: Request) -> None:
        entry = self.entries.pop(request.request_id, None)
        if entry is not None:
            self.token_budget += entry[1]
        self.draft_token_ids.pop(request.request_id, None)
        self.preempted_request_ids.append(request.request_id)


class Scheduler(LoadingRequests):
    """Decides each step's batch over a block pool; owns the waiting queue and the running batch (loading state:
    scheduler_loading)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_pool = BlockPool(config.num_blocks, config.enable_prefix_caching, config.enable_kv_events)
        #: One block table per request, or (KV by layer type) one per KV group.
        self.kv_manager: KVCacheManager | HybridKVCacheManager = (
            HybridKVCacheManager(self.block_pool, config.block_size, config.kv_groups, config.hybrid_checkpoint_tokens)
            if config.kv_groups else KVCacheManager(self.block_pool, config.block_size))
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        #: Sorted by arrival, so the last one is the preemption victim and is never scheduled before it.
        self.running: list[Request] = []
        self._arrival_key: dict[str, tuple[float, int]] = {}
        self._add_order = itertools.count()
        #: Requests admitted so far (add_request, add_prefilled_request): heartbeats carry it, so a router
        #: knows how many of the requests it sent have arrived.
        self.num_added = 0
        self._finished_request_ids: list[str] = []
        #: Finished requests whose blocks stay referenced until release_held (prefill leases).
        self._held: dict[str, list[KVCacheBlock]] = {}
        #: Blocks of each request already sent to the runner; absent = the runner holds no row for it (is_new).
        self._num_sent_blocks: dict[str, int] = {}
        self.loading: dict[str, Request] = {}  # the loading state (scheduler_loading)
        #: The host tier's lookup for a preempted request resuming: True when it took it (loading); None: recompute.
        self.resume_loader: Callable[[Request], bool] | None = None
        self.admission_window = AdmissionWindow(config.admission_window_s)
        #: Prompt tokens one step may compute beside its decodes (a ChunkTimer sets it on the CPU); None = the
        #: token budget alone.
        self.max_prefill_tokens: int | None = None

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (new or preempted)."""
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        """True while some request is running or waiting (loading ones wait for finish_loading, not a step)."""
        return bool(self.running or self.waiting)

    def has_finished_requests(self) -> bool:
        """True when finished request ids wait to be reported by the next schedule()."""
        return bool(self._finished_request_ids)

    def add_request(self, request: Request) -> None:
        """Queue a new request; ValueError when it is empty, duplicate or longer than max_model_len."""
        self._register(request)
        self.waiting.append(request)
        self.num_added += 1
        self.admission_window.note_arrival()

    def _register(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} already exists")
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} is not a new request ({request.status.name})")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_tokens > self.config.max_model_len:
            raise ContextLengthExceeded(
                f"request {request.request_id!r}: {request.num_tokens} tokens are longer than "
                f"max_model_len={self.config.max_model_len}"
            )
        if request.hold_blocks and self.config.kv_groups:
            raise ValueError(HYBRID_NO_HANDOFF)
        request.bind_block_hashing(self.config.block_size, self.config.model_fingerprint)
        self.requests[request.request_id] = request
        self._arrival_key[request.request_id] = (request.arrival_time, next(self._add_order))

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish requests as aborted and drop every block reference (cached blocks stay reusable)."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.loading[request_id]
            else:
                self.waiting.remove(request)
            request.finish(RequestStatus.FINISHED_ABORTED, FinishReason.ABORT)
            self._retire(request)
            aborted.append(request)
        return aborted

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating (or preempting for) their blocks."""
        step = _Step(self.config.max_num_batched_tokens)
        decodes, prefills = self._split_running()
        running_status = RequestStatus.RUNNING
        self._schedule_decodes(decodes, step)
        if self.max_prefill_tokens is not None:  # chunks and admissions share a time-bounded part of the budget
            step.token_budget = min(step.token_budget, self.max_prefill_tokens)
        for request in prefills:
            if step.token_budget == 0:
                break
            if request.status is not running_status:  # preempted earlier in this step
                continue
            num_new_tokens = self._chunk_size(request, request.num_computed_tokens, step.token_budget)
            if self._allocate_or_preempt(request, num_new_tokens, step):
                step.add(request, num_new_tokens)
        if not step.preempted_request_ids:
            self._admit_waiting(step)
        return self._build_output(step)

    def _schedule_decodes(self, decodes: list[Request], step: _Step) -> None:
        """One token for each decode (its chunk whatever the budget left or the threshold), in order; with its
        draft tokens when it has some and they fit without preempting anyone."""
        running_status, block_size = RequestStatus.RUNNING, self.config.block_size
        req_to_blocks, entries = self.kv_manager.req_to_blocks, step.entries
        for request in decodes:
            if step.token_budget == 0:
                break
            if request.status is not running_status:  # preempted earlier in this step
                continue
            if request.draft_token_ids and self._schedule_drafts(request, step):
                continue
            blocks = req_to_blocks.get(request.request_id)
            # allocate_slots' every-step case inline: the last block has room for the token (no new block).
            no_room = blocks is None or request.num_computed_tokens >= len(blocks) * block_size
            if no_room and not self._allocate_or_preempt(request, 1, step):
                continue
            entries[request.request_id] = (request, 1)  # step.add(request, 1)
            step.token_budget -= 1

    def _schedule_drafts(self, request: Request, step: _Step) -> bool:
        """Schedule a decode with its draft tokens (cut to the budget, max_model_len and max_tokens: a step
        never computes a position the request could not keep); False when none fit or their blocks are not free
        (it then decodes as usual, never preempting another request for a draft)."""
        draft_token_ids, request.draft_token_ids = request.draft_token_ids, ()
        num_drafts = min(len(draft_token_ids), step.token_budget - 1,
                         self.config.max_model_len - request.num_tokens - 1)
        max_tokens = request.stop_rule.max_tokens
        if max_tokens is not None:
            num_drafts = min(num_drafts, max_tokens - request.num_output_tokens - 1)
        if num_drafts <= 0 or self.kv_manager.allocate_slots(request, 1 + num_drafts) is None:
            return False
        step.add(request, 1 + num_drafts)
        step.draft_token_ids[request.request_id] = draft_token_ids[:num_drafts]
        return True

    def _split_running(self) -> tuple[list[Request], list[Request]]:
        """Running requests to schedule this step: (decodes, prefill chunks); decodes go first."""
        decodes, prefills = [], []
        for r in self.running:
            (decodes if len(r.all_token_ids) - r.num_computed_tokens == 1 else prefills).append(r)
        return decodes, prefills

    def update(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]]
    ) -> list[RequestUpdate]:
        """Apply a step's results: advance KV progress, append sampled tokens, cache full blocks, finish."""
        return self._update(output, sampled_token_ids, False)

    def update_sampled(self, output: SchedulerOutput, sampled: Mapping[str, SampledToken]) -> list[EngineOutput]:
        """update() with each sampled request's one token as the runner returns it (a step without drafts): the
        same updates, each carrying its token as `new_logprobs`, without a list of ids per request first."""
        return self._update(output, sampled, True)

    def _update(self, output: SchedulerOutput, sampled_token_ids: Mapping, with_tokens: bool) -> list[RequestUpdate]:
        """update(); with_tokens: the mapping's values are SampledTokens (update_sampled)."""
        missing = [
            s.request_id for s in output.scheduled if s.sample and not sampled_token_ids.get(s.request_id)
        ]
        if missing:  # checked before any change, so a bad runner result leaves the scheduler as it was
            raise ValueError(f"no sampled token for requests {missing}, which had to sample")
        requests, running_status = self.requests, RequestStatus.RUNNING
        max_model_len, block_size = self.config.max_model_len, self.config.block_size
        cache_blocks = self.kv_manager.cache_blocks
        updates, finished = [], []
        for scheduled in output.scheduled:
            request = requests.get(scheduled.request_id)
            if request is None or request.status is not running_status:
                continue  # aborted since schedule()
            num_computed = scheduled.num_computed_tokens
            assert request.num_computed_tokens == num_computed, "update() without schedule()"
            if scheduled.num_draft_tokens:
                assert not with_tokens, "a step that verified drafts is updated with every emitted token"
                update = self._update_verified(request, scheduled, sampled_token_ids[scheduled.request_id])
                updates.append(update)
                if request.status is not running_status:
                    finished.append(request)
                continue
            request.num_computed_tokens = num_computed + scheduled.num_new_tokens
            if (num_computed + scheduled.num_new_tokens) // block_size > num_computed // block_size:
                cache_blocks(request, request.num_computed_tokens)  # a block became full this step
            if not scheduled.sample:
                continue
            token_ids = sampled_token_ids[scheduled.request_id]
            if with_tokens:  # one SampledToken
                new_logprobs = [token_ids]
                new_token_ids = [token_ids.token_id]
                append_sampled_token(request, new_token_ids[0], max_model_len)
            else:
                new_logprobs, new_token_ids = None, self._append_sampled(request, token_ids, max_model_len)
            if request.status is not running_status:
                finished.append(request)
            updates.append(
                RequestUpdate(
                    request.request_id, new_token_ids, new_logprobs, request.finish_reason, request.stop_reason,
                    request.num_cached_tokens, request.first_scheduled_time, request.num_store_cached_tokens,
                    request.num_host_cached_tokens,
                )
            )
            if request.prompt_logprobs is not None:  # its first token: the prompt's logprobs go with it, once
                updates[-1].prompt_logprobs = hand_out_prompt_logprobs(request)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for request in finished:
                self._retire(request)
        return updates

    def _update_verified(self, request: Request, scheduled: ScheduledRequest, token_ids: Sequence[int]) -> RequestUpdate:
        """Apply a step that verified drafts: keep the emitted tokens up to the first that stops the request, keep
        the KV of the fed token and of the drafts among them, and free the blocks past that (rejected drafts' KV)::

            fed       | last | d0 | d1 | d2 |        k = 3, d0 d1 accepted, t2 emitted at d2's row (or a bonus)
            emitted          | d0 | d1 | t2 |        3 tokens; KV kept for last, d0, d1: num_computed += 3
            blocks    held for cdiv(num_computed, block_size) tokens, as a step without drafts would leave them

        Only then are full blocks cached, so no rejected token is ever hashed, cached or announced."""
        new_token_ids = self._append_sampled(request, token_ids, self.config.max_model_len)
        num_computed = scheduled.num_computed_tokens
        request.num_computed_tokens = num_computed + len(new_token_ids)
        block_size = self.config.block_size
        if request.num_computed_tokens // block_size > num_computed // block_size:
            self.kv_manager.cache_blocks(request, request.num_computed_tokens)
        if self.kv_manager.free_tail(request, request.num_computed_tokens):
            # The runner's row still lists the freed blocks: send it the whole table at the next step.
            self._num_sent_blocks.pop(request.request_id, None)
        return RequestUpdate(
            request.request_id, new_token_ids, None, request.finish_reason, request.stop_reason,
            request.num_cached_tokens, request.first_scheduled_time, request.num_store_cached_tokens,
            request.num_host_cached_tokens,
        )

    @staticmethod
    def _append_sampled(request: Request, token_ids: Sequence[int], max_model_len: int) -> list[int]:
        """Append sampled tokens up to the first that stops the request; the tokens kept."""
        if len(token_ids) == 1:
            append_sampled_token(request, token_ids[0], max_model_len)
            return list(token_ids)
        kept: list[int] = []
        for token_id in token_ids:
            request.append_output_token_id(token_id)
            kept.append(token_id)
            if check_stop(request, max_model_len):
                break
        return kept

    def add_prefilled_request(self, request: Request, num_prefilled_tokens: int) -> list[int] | None:
        """Admit a request whose first `num_prefilled_tokens` tokens were computed elsewhere (disaggregated
        prefill): allocate their blocks now and return the ids of the blocks the caller must fill with the
        pulled KV, in token order; local prefix-cache hits are reused and not returned. None = no room now.

        The request's output may already hold tokens (the prefill worker's first token); they are computed
        by the next step like any decode. Call `commit_prefilled` once the blocks hold the KV.
        """
        if self.config.kv_groups:
            raise ValueError(HYBRID_NO_HANDOFF)
        if not 0 < num_prefilled_tokens < request.num_tokens or self._num_seqs() >= self.config.max_num_seqs:
            return None
        request.bind_block_hashing(self.config.block_size, self.config.model_fingerprint)
        computed_blocks, num_hit_tokens = self.kv_manager.get_computed_blocks(request)
        num_hit_tokens = min(num_hit_tokens, num_prefilled_tokens)
        computed_blocks = computed_blocks[: num_hit_tokens // self.config.block_size]
        new = self.kv_manager.allocate_slots(request, num_prefilled_tokens - num_hit_tokens, computed_blocks)
        if new is None:
            return None
        self.requests[request.request_id] = request
        self._arrival_key[request.request_id] = (request.arrival_time, next(self._add_order))
        request.num_cached_tokens = num_hit_tokens
        request.num_computed_tokens = num_prefilled_tokens
        request.status = RequestStatus.RUNNING
        self.num_added += 1
        bisect.insort(self.running, request, key=lambda r: self._arrival_key[r.request_id])
        self._num_sent_blocks.pop(request.request_id, None)  # the runner gets the whole table at the next step
        return self.kv_manager.get_block_ids(request)[len(computed_blocks) :]

    def _num_seqs(self) -> int:
        return len(self.running) + len(self.loading)

    def commit_prefilled(self, request_id: str) -> None:
        """The pulled KV is in place: register the request's full prompt blocks in the prefix cache."""
        request = self.requests[request_id]
        self.kv_manager.cache_blocks(request, request.num_computed_tokens)

    def held_block_ids(self, request_id: str) -> list[int] | None:
        """Block ids kept for a finished request that asked to hold its blocks (a prefill lease)."""
        blocks = self._held.get(request_id)
        return None if blocks is None else [b.block_id for b in blocks]

    def release_held(self, request_id: str) -> bool:
        """End a lease: drop the held block references (cached ones stay reusable). False if none held."""
        blocks = self._held.pop(request_id, None)
        if blocks is None:
            return False
        self.block_pool.free_blocks(reversed(blocks))
        return True

    @property
    def num_held(self) -> int:
        """Finished requests whose blocks are still held under a lease."""
        return len(self._held)

    def take_kv_events(self) -> list[KvCacheEvent]:
        """Prefix-cache events (Stored / Removed / AllCleared) since the last call."""
        return self.block_pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False while requests hold blocks."""
        return self.block_pool.reset_prefix_cache()

    def _chunk_size(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        num_new_tokens = min(request.num_tokens - num_computed_tokens, token_budget)
        threshold = self.config.long_prefill_token_threshold
        return num_new_tokens if threshold is None else min(num_new_tokens, threshold)

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, step: _Step) -> bool:
        while self.kv_manager.allocate_slots(request, num_new_tokens) is None:
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, step: _Step) -> None:
        self.running.pop(self.running.index(request))
        self.kv_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_sent_blocks.pop(request.request_id, None)
        self.waiting.appendleft(request)
        step.drop(request)

    def _admit_waiting(self, step: _Step) -> None:
        if self.waiting and self.admission_window.holds(self.waiting[0], bool(self.running)):
            return  # the rest of its burst is still arriving
        offered: list[Request] = []  # to resume_loader, once a step: one whose load failed is recomputed now
        while self.waiting and step.token_budget > 0 and self._num_seqs() < self.config.max_num_seqs:
            request = self.waiting[0]
            resuming = self.resume_loader is not None and request.status is RequestStatus.PREEMPTED
            if resuming and request not in offered:
                offered.append(request)
                if self.resume_loader(request):
                    continue  # loading from the host tier (or failed to start: back at the head, recomputed)
            computed_blocks, num_hit_tokens = self.kv_manager.get_computed_blocks(request)
            num_new_tokens = self._chunk_size(request, num_hit_tokens, step.token_budget)
            if self.kv_manager.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: self._arrival_key[r.request_id])
            step.add(request, num_new_tokens)

    def _build_output(self, step: _Step) -> SchedulerOutput:
        output = SchedulerOutput(
            preempted_request_ids=step.preempted_request_ids,
            finished_request_ids=self._finished_request_ids,
        )
        self._finished_request_ids = []
        sent, req_to_blocks = self._num_sent_blocks, self.kv_manager.req_to_blocks
        scheduled, num_batched_tokens = output.scheduled, 0
        for request, num_new_tokens in step.entries.values():
            request_id, start = request.request_id, request.num_computed_tokens
            all_token_ids, blocks = request.all_token_ids, req_to_blocks.get(request_id, ())
            num_sent = sent.get(request_id)
            # The every-step case: no block since the last step.
            new_block_ids = [] if num_sent == len(blocks) else self._send_block_ids(request_id, blocks, num_sent)
            end = start + num_new_tokens
            draft_token_ids = step.draft_token_ids.get(request_id) if step.draft_token_ids else None
            if draft_token_ids:  # the last token, then the drafts: every row samples
                num_drafts = len(draft_token_ids)
                output.num_draft_tokens += num_drafts
                scheduled.append(ScheduledRequest(
                    request_id, [all_token_ids[start], *draft_token_ids], start, num_new_tokens, new_block_ids,
                    True, num_sent is None, num_drafts,
                ))
            else:
                scheduled.append(
                    ScheduledRequest(
                        request_id, all_token_ids[start:end], start, num_new_tokens, new_block_ids,
                        end == len(all_token_ids), num_sent is None,
                    )
                )
            num_batched_tokens += num_new_tokens
        output.num_batched_tokens = num_batched_tokens
        return output

    def _send_block_ids(self, request_id: str, blocks: Sequence[KVCacheBlock], num_sent: int | None) -> list[int]:
        """The ids of a request's blocks the runner has not been sent (all of them when num_sent is None; with KV
        groups, every group's, interleaved: HybridKVCacheManager.block_ids_from)."""
        self._num_sent_blocks[request_id] = len(blocks)
        if self.config.kv_groups:
            return self.kv_manager.block_ids_from(request_id, num_sent or 0)
        return [block.block_id for block in (blocks if num_sent is None else blocks[num_sent:])]

    def _retire(self, request: Request) -> None:
        if request.hold_blocks and request.finish_reason is not FinishReason.ABORT:
            self._held[request.request_id] = self.kv_manager.detach(request)
        else:
            self.kv_manager.free(request)
        del self.requests[request.request_id]
        del self._arrival_key[request.request_id]
        self._num_sent_blocks.pop(request.request_id, None)
        self._finished_request_ids.append(request.request_id)
