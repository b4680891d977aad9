"""`AsyncScheduler`: schedule step N+1 before step N's tokens reach the host (vLLM v1's async scheduling). No torch.

The loop it serves (EngineCore with `async_scheduling=True`):

    schedule(N+1) → launch(N+1) → wait for N's tokens → update(N)       (at most one step in flight)

A running request whose step N samples a token holds one *output placeholder* until update(N) appends the real
token. schedule(N+1) counts it as if it were appended, so positions and block allocation are right:

    all_token_ids  | p0 p1 p2 o0 o1 |  ?  |        ? = placeholder (sampled by step N, not on the host yet)
    num_computed   |<-- after N ---->|     |       advanced at schedule time, not in update()
    step N+1 feeds |                 |  ?  |       ScheduledRequest.token_ids = [] (the runner takes the id
                                                   from step N's sampled ids on the device)

Stops discovered late (eos, stop id, max_tokens only once update(N) sees the token) mean step N+1 computed one
token too many for that request: update(N) finishes it and frees its blocks, update(N+1) drops the extra token.
A request whose pending tokens already reach max_tokens or max_model_len is not scheduled (update(N) ends it).
A request preempted while its step is in flight keeps its placeholder; update() still appends that token.
Speculative decoding: a step that feeds draft tokens is scheduled only with no step in flight (EngineCore finishes
it first) and is built and updated as the base Scheduler does (num_computed_tokens advanced by update(), the
rejected drafts' blocks freed there): a synchronous step between asynchronous ones.
Mixed prefill+decode steps need nothing special: prefill chunks only feed known tokens (a request is never
re-admitted, nor resumed from the host tier, while it holds a placeholder, since preemption steps admit nobody
and update(N) runs before schedule(N+2)).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.outputs import EngineOutput, SampledToken
from deepinfer.engine.request import Request, RequestStatus, append_sampled_token, hand_out_prompt_logprobs
from deepinfer.engine.scheduler import RequestUpdate, ScheduledRequest, Scheduler, SchedulerOutput, _Step

#: update()'s stand-in for the tokens of a request that did not sample (truthy: only a sampled one may be missing).
_NOT_SAMPLED = (None,)


class AsyncScheduler(Scheduler):
    """A Scheduler whose schedule() may run once more before update() of the previous step (see module doc)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        #: Sampled tokens of each request not appended yet: at most 2 (the step in flight and the one just
        #: scheduled, between schedule(N+1) and update(N)).
        self.num_output_placeholders: dict[str, int] = {}
        #: Steps scheduled but not updated, oldest first, with the Request objects they scheduled (an id may be
        #: aborted and added again while its step is in flight; the object tells them apart).
        self._in_flight: deque[tuple[SchedulerOutput, list[Request]]] = deque()

    @property
    def num_in_flight(self) -> int:
        """Steps scheduled and not updated yet."""
        return len(self._in_flight)

    def _split_running(self) -> tuple[list[Request], list[Request]]:
        """As the base, counting in-flight tokens as appended; a request they already end is left out."""
        placeholders, max_model_len = self.num_output_placeholders, self.config.max_model_len
        decodes, prefills = [], []
        for r in self.running:
            num_pending = placeholders.get(r.request_id, 0)
            num_tokens = len(r.all_token_ids) + num_pending
            if num_pending:  # do the tokens in flight already reach max_model_len or max_tokens?
                max_tokens = (r._stop_rule or r.stop_rule).max_tokens  # the attribute first: every request, every step
                if num_tokens >= max_model_len or (
                    max_tokens is not None and len(r.output_token_ids) + num_pending >= max_tokens
                ):
                    continue  # its in-flight token ends it; update() will finish it
            (decodes if num_tokens - r.num_computed_tokens == 1 else prefills).append(r)
        return decodes, prefills

    def _chunk_size(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        num_pending = self.num_output_placeholders.get(request.request_id, 0)
        num_new_tokens = min(request.num_tokens + num_pending - num_computed_tokens, token_budget)
        threshold = self.config.long_prefill_token_threshold
        return num_new_tokens if threshold is None else min(num_new_tokens, threshold)

    def _build_output(self, step: _Step) -> SchedulerOutput:
        """As the base, in the same loop: a fed placeholder samples and counts one more, and num_computed_tokens
        advances now (module doc). A step with draft tokens is the base's (nothing may be in flight)."""
        if step.draft_token_ids:
            assert not self._in_flight, "a step with draft tokens is scheduled with no step in flight"
            return super()._build_output(step)
        output = SchedulerOutput(
            preempted_request_ids=step.preempted_request_ids,
            finished_request_ids=self._finished_request_ids,
        )
        self._finished_request_ids = []
        sent, req_to_blocks = self._num_sent_blocks, self.kv_manager.req_to_blocks
        placeholders, scheduled, requests, num_batched_tokens = self.num_output_placeholders, output.scheduled, [], 0
        for request, num_new_tokens in step.entries.values():
            request_id, start = request.request_id, request.num_computed_tokens
            all_token_ids, blocks = request.all_token_ids, req_to_blocks.get(request_id, ())
            num_sent = sent.get(request_id)
            # The every-step case: no block since the last step.
            new_block_ids = [] if num_sent == len(blocks) else self._send_block_ids(request_id, blocks, num_sent)
            end = start + num_new_tokens
            token_ids = all_token_ids[start:end]
            num_known = len(token_ids)
            if num_known < num_new_tokens:  # a placeholder is fed: the known tokens stop short, and the step samples
                # Never on a fresh runner row: the placeholder's id sits in the row that sampled it.
                assert num_sent is not None, request_id
                num_pending = placeholders.get(request_id, 0)
                assert num_pending == num_new_tokens - num_known, (request_id, num_pending)
                sample = True
                placeholders[request_id] = num_pending + 1
            else:
                sample = end == len(all_token_ids)
                if sample:
                    placeholders[request_id] = placeholders.get(request_id, 0) + 1
            scheduled.append(
                ScheduledRequest(request_id, token_ids, start, num_new_tokens, new_block_ids, sample, num_sent is None)
            )
            request.num_computed_tokens = end
            requests.append(request)
            num_batched_tokens += num_new_tokens
        output.num_batched_tokens = num_batched_tokens
        self._in_flight.append((output, requests))
        return output

    def update(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]]
    ) -> list[RequestUpdate]:
        """Apply the oldest in-flight step's tokens: resolve placeholders, cache full blocks, finish, discard."""
        return self._update(output, sampled_token_ids, False)

    def update_sampled(self, output: SchedulerOutput, sampled: Mapping[str, SampledToken]) -> list[EngineOutput]:
        """update() with each sampled request's one token as the runner returns it (`PendingSample.result()`):
        the same updates, each carrying its token as `new_logprobs`, without a list of ids per request first."""
        return self._update(output, sampled, True)

    def _update(self, output: SchedulerOutput, sampled_token_ids: Mapping, with_tokens: bool) -> list[RequestUpdate]:
        """update(); with_tokens: the mapping's values are SampledTokens (update_sampled). A step with draft tokens
        was the base's, and is updated as the base does."""
        if output.num_draft_tokens and not (self._in_flight and self._in_flight[0][0] is output):
            return super()._update(output, sampled_token_ids, with_tokens)
        if not self._in_flight or self._in_flight[0][0] is not output:
            raise ValueError("update() must take the oldest scheduled step that has not been updated")
        get_tokens = sampled_token_ids.get
        step_tokens = [get_tokens(s.request_id) if s.sample else _NOT_SAMPLED for s in output.scheduled]
        if not all(step_tokens):  # checked before any change, so a bad runner result leaves the scheduler as it was
            missing = [s.request_id for s, token_ids in zip(output.scheduled, step_tokens, strict=True) if not token_ids]
            raise ValueError(f"no sampled token for requests {missing}, which had to sample")
        _, scheduled_requests = self._in_flight.popleft()
        live, placeholders = self.requests, self.num_output_placeholders
        max_model_len, block_size = self.config.max_model_len, self.config.block_size
        kv_manager = self.kv_manager
        cache_blocks, num_cached_blocks = kv_manager.cache_blocks, kv_manager.num_cached_blocks
        caching = kv_manager.block_pool.enable_caching
        running, preempted = RequestStatus.RUNNING, RequestStatus.PREEMPTED
        updates, finished = [], []
        new_logprobs = None
        for scheduled, request, token_ids in zip(output.scheduled, scheduled_requests, step_tokens, strict=True):
            request_id = request.request_id
            if live.get(request_id) is not request:
                continue  # finished or aborted since schedule(): an extra token, never emitted
            status, stopped = request.status, False  # a live request has not finished before this update
            sample = scheduled.sample
            if sample:
                placeholders[request_id] -= 1
                if with_tokens:  # one SampledToken
                    new_logprobs = [token_ids]
                    token_id = token_ids.token_id
                    new_token_ids = [token_id]
                    stopped = append_sampled_token(request, token_id, max_model_len)
                elif len(token_ids) == 1:  # the decode step's case
                    token_id = token_ids[0]
                    new_token_ids = [token_id]
                    stopped = append_sampled_token(request, token_id, max_model_len)
                else:
                    new_token_ids = self._append_sampled(request, token_ids, max_model_len)
                    stopped = request.status.is_finished
            if caching and (status is running or stopped):
                # Blocks full of known tokens; their KV is written by this step or one queued after it. A request
                # that just finished still owns its blocks here (retired below), so its prompt stays cached.
                num_known, num_tokens = request.num_computed_tokens, len(request.all_token_ids)
                if num_known > num_tokens:
                    num_known = num_tokens
                if num_known // block_size > num_cached_blocks.get(request_id, 0):  # cache_blocks' early-out
                    cache_blocks(request, num_known)
            if not sample:
                continue
            if stopped:
                finished.append((request, status is preempted))  # preempted while its step was in flight?
            updates.append(
                RequestUpdate(
                    request_id, new_token_ids, new_logprobs, request.finish_reason, request.stop_reason,
                    request.num_cached_tokens, request.first_scheduled_time, request.num_store_cached_tokens,
                    request.num_host_cached_tokens,
                )
            )
            if request.prompt_logprobs is not None:  # its first token: the prompt's logprobs go with it, once
                updates[-1].prompt_logprobs = hand_out_prompt_logprobs(request)
        if finished:
            self._finish(finished)
        return updates

    def _finish(self, finished: list[tuple[Request, bool]]) -> None:
        done = {id(r) for r, _ in finished}
        self.running = [r for r in self.running if id(r) not in done]
        for request, was_preempted in finished:
            if was_preempted:  # preempted while its step was in flight: it waits in the queue
                self.waiting.remove(request)
            self._retire(request)

    def _retire(self, request: Request) -> None:
        self.num_output_placeholders.pop(request.request_id, None)
        super()._retire(request)
