"""A request the workers took: its token chunks, and its migration when the decode worker is lost mid-stream.

    async for chunk in running.chunks():   # TokenChunks until finish_reason, or an ApiError
        ...
    running.stop("stop string")            # ends it early: Cancel tells every worker to drop it
    running.abort(error)                   # shutdown past the drain grace: chunks() raises `error`

Migration (on by default, `GatewaySettings.migration`): when the decode worker dies or goes silent (its heartbeats
stop, no chunk within the silence limit, or it reports the request lost or refused), or a chunk of its stream was
lost in transit (a gap in `num_previous_tokens`, e.g. across a NATS restart), the request is re-issued
through the scheduler (the lost worker excluded while another can take it) to a decode worker as prompt + the
tokens already consumed here (`output_token_ids`), under a new wire id (`<id>-m<n>`: a late chunk of the lost
worker is dropped, its Cancel cannot hit the new attempt). Until a worker takes it (none free, the lost one
restarting, NATS reconnecting) it is tried again every `retry_after_s`, for up to `migration_wait_s`. The seed is fixed per request in the gateway and the
draw is a function of (seed, position), so the new worker continues exactly; max_tokens, min_tokens, penalties,
stop ids and the grammar count the tokens already sent on the worker, and the gateway's own state (detokenizer,
stop strings, grammar check, usage) continues untouched. At most `migration_budget` migrations per request; then
the error of today (an error event, or a 502).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from deepinfer.protocol import ErrorCode, FinishReason, PrefillResult, RouteDecision, TokenChunk
from services.gateway.errors import ApiError, from_wire, timed_out, worker_lost
from services.gateway.recipe import GenerateRequest
from services.gateway.streams import RequestStream

if TYPE_CHECKING:
    from services.gateway.pipeline import RequestPipeline

log = logging.getLogger(__name__)

#: Failures that mean "this worker is lost or cannot take the request now": another worker may.
REISSUE_CODES = frozenset({ErrorCode.WORKER_LOST, ErrorCode.OVERLOADED})


def attempt_id(request_id: str, attempt: int) -> str:
    """The wire id of a request's attempt `attempt` (0: the request's own id)."""
    return request_id if attempt == 0 else f"{request_id}-m{attempt}"


class RunningRequest:
    """A request the decode worker accepted (or the prefill already finished): its token chunks."""

    def __init__(
        self,
        pipeline: RequestPipeline,
        request: GenerateRequest,
        decision: RouteDecision,
        prefill: PrefillResult | None,
        stream: RequestStream,
        num_reissues: int = 0,
    ) -> None:
        self.pipeline = pipeline
        self.request = request
        self.decision = decision
        self.prefill = prefill
        self.stream = stream
        self.finished = False
        #: Re-issues so far (prefill retries at the start included); bounded by settings.migration_budget.
        self.num_reissues = num_reissues
        #: Attempts so far after the first (each has its own wire id; a migration may take several tries).
        self.num_attempts = num_reissues
        #: Every token handed to the caller, in order: what a migrated request resumes from.
        self.sent_token_ids: list[int] = []
        #: Set by abort(): chunks() raises it at once.
        self.aborted: ApiError | None = None
        pipeline.running.add(self)

    @property
    def request_id(self) -> str:
        """The id the workers know the current attempt by."""
        return self.stream.request_id

    @property
    def worker_id(self) -> str:
        """The decode worker of the current attempt."""
        return self.decision.decode_worker_id or ""

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        """The prefill's first token, then the decode worker's chunks (across migrations), until one carries a
        finish_reason. Raises ApiError when the worker fails, dies or goes silent (502) and no migration is left,
        or the deadline passes (504). Leaving early (break, close) cancels."""
        try:
            if self.prefill is not None and (
                self.prefill.first_token_id is not None or self.prefill.finish_reason is not None
            ):
                first = _first_chunk(self.prefill)
                self.finished = first.finish_reason is not None
                self.sent_token_ids.extend(first.token_ids)
                yield first
                if self.finished:
                    return
            while True:
                try:
                    async for chunk in self._decoded():
                        self.sent_token_ids.extend(chunk.token_ids)
                        yield chunk
                    return
                except ApiError as exc:
                    if not self._may_migrate(exc):
                        raise
                    ending = await self._migrate(exc)
                if ending is not None:  # every token was already sent: only the finish was lost
                    self.finished = True
                    yield ending
                    return
        except ApiError as exc:
            self.stop(f"gateway gave up: {exc.message}")
            raise
        finally:
            self.stop("client disconnected")

    async def _decoded(self) -> AsyncIterator[TokenChunk]:
        settings, is_disconnected = self.pipeline.settings, self.request.is_disconnected
        worker_id = self.worker_id
        silence_limit_s = settings.first_token_timeout_s
        last_chunk_s = last_check_s = time.monotonic()
        while True:
            left_s = self.request.deadline_s - time.monotonic()
            if left_s <= 0:
                raise timed_out(settings.request_timeout_s)
            chunk = await self.stream.get(min(settings.poll_interval_s, left_s))
            if self.aborted is not None:
                raise self.aborted
            if is_disconnected is not None and time.monotonic() - last_check_s >= settings.poll_interval_s:
                last_check_s = time.monotonic()
                if await is_disconnected():
                    return
            if chunk is None:
                if self.stream.broken is not None:
                    raise worker_lost(f"decode worker {worker_id}: {self.stream.broken}")
                if self.pipeline.membership.is_alive(worker_id) is False:
                    raise worker_lost(f"decode worker {worker_id} stopped sending heartbeats")
                if time.monotonic() - last_chunk_s > silence_limit_s:
                    raise worker_lost(f"decode worker {worker_id} sent no tokens for {silence_limit_s:g} s")
                continue
            silence_limit_s = settings.stream_timeout_s
            last_chunk_s = time.monotonic()
            if chunk.error is not None or chunk.finish_reason is FinishReason.ERROR:
                self.finished = True  # the worker already dropped it
                if chunk.error is None:
                    raise worker_lost(f"decode worker {worker_id} failed")
                raise from_wire(chunk.error, f"decode worker {worker_id} failed", settings.retry_after_s)
            self.finished = chunk.finish_reason is not None
            yield chunk
            if self.finished:
                return

    def _may_migrate(self, exc: ApiError) -> bool:
        """Whether `exc` (raised mid-stream) may be answered by resuming on another worker."""
        return self._may_retry(exc) and self.num_reissues < self.pipeline.settings.migration_budget

    def _may_retry(self, exc: ApiError) -> bool:
        """Whether a lost or refused attempt may be followed by another (the budget aside)."""
        return (
            self.pipeline.settings.migration
            and self.aborted is None
            and not self.pipeline.closing
            and exc.error_code in REISSUE_CODES
            and time.monotonic() < self.request.deadline_s
        )

    async def _migrate(self, lost: ApiError) -> TokenChunk | None:
        """Resume on another decode worker (re-issues counted; ApiError when the budget runs out first).
        Returns a closing chunk instead when the tokens sent already reach max_tokens."""
        settings, sampling = self.pipeline.settings, self.request.sampling
        old_id, lost_worker = self.request_id, self.worker_id
        self.stream.close()
        if not self.finished:
            self.pipeline.cancel_soon(old_id, f"migrated: {lost.message}")
        self.finished = False
        if sampling.max_tokens is not None and len(self.sent_token_ids) >= sampling.max_tokens:
            return TokenChunk(request_id=old_id, token_ids=[], finish_reason=FinishReason.LENGTH)
        self.num_reissues += 1
        give_up_s = min(self.request.deadline_s, time.monotonic() + settings.migration_wait_s)
        while True:
            self.num_attempts += 1
            new_id = attempt_id(self.request.request_id, self.num_attempts)
            log.warning("request %s: %s; resuming as %s after %d tokens", old_id, lost.message, new_id,
                        len(self.sent_token_ids), extra={"request_id": self.request.request_id})
            try:
                self.decision, self.stream = await self.pipeline.resume(
                    self.request, new_id, self.sent_token_ids, exclude=[lost_worker]
                )
                return None
            except ApiError as exc:  # no scheduler, no decode worker free or alive yet (a restart, a NATS outage)
                if not (self._may_retry(exc) and time.monotonic() < give_up_s):
                    break
            await asyncio.sleep(min(settings.retry_after_s, max(0.0, give_up_s - time.monotonic())))
        self.finished = True  # nothing runs on any worker now
        raise self.aborted or lost

    def abort(self, error: ApiError) -> None:
        """End the request with `error` (shutdown): chunks() raises it at its next wake-up, which comes now."""
        self.aborted = error
        self.stream.queue.put_nowait(TokenChunk(request_id=self.request_id, token_ids=[]))

    def stop(self, reason: str) -> None:
        """End the request here; unless it already finished, Cancel tells the workers to drop it."""
        self.stream.close()
        self.pipeline.running.discard(self)
        if not self.finished:
            self.finished = True
            self.pipeline.cancel_soon(self.request_id, reason)


def _first_chunk(prefill: PrefillResult) -> TokenChunk:
    """The prefill worker's first token, as the first chunk of the stream."""
    return TokenChunk(
        request_id=prefill.request_id,
        token_ids=[] if prefill.first_token_id is None else [prefill.first_token_id],
        logprobs=None if prefill.first_logprobs is None else [prefill.first_logprobs],
        finish_reason=prefill.finish_reason,
        num_cached_tokens=prefill.num_cached_tokens,
        cached_tokens_by_tier=prefill.cached_tokens_by_tier or None,
        prompt_logprobs=prefill.prompt_logprobs,
    )
