"""The request pipeline on the workers' side: receive → route → prefill → decode → stream tokens.

    running = await handler.start(request)          # route, prefill, decode: any failure here is an HTTP error
    async for chunk in running.chunks():            # TokenChunks until finish_reason, or an ApiError (502)
        ...
    running.stop("stop string")                     # ends it early: Cancel tells both workers to drop it

Failures before the first token are 503s (retryable: the scheduler picks another worker on the retry); failures
after are 502s, or an error event for a stream that already started. A worker that stops heartbeating or a
stream that goes silent ends the request within `stream_timeout_s` / the heartbeat lease, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from deepinfer import subjects
from deepinfer.bus import BusError, MessageBus, NoResponders
from deepinfer.protocol import (
    Cancel,
    DecodeAccepted,
    DecodeRequest,
    FinishReason,
    Message,
    PrefillRequest,
    PrefillResult,
    RouteDecision,
    RouteRequest,
    RouteStatus,
    TokenChunk,
)
from services.gateway.errors import ApiError, bad_request, overloaded, upstream_failed
from services.gateway.recipe import GenerateRequest
from services.gateway.streams import RequestStream, TokenStreams
from services.gateway.workers import WorkerTable

logger = logging.getLogger(__name__)

# Words in a worker's error text that mean the request itself was bad (the wire has no error code yet).
_CLIENT_ERROR_WORDS = ("invalid", "too long", "exceeds", "out of range")


@dataclass(frozen=True)
class GatewayTimeouts:
    """How long each hop may take (the lead moves these into GatewaySettings)."""

    route_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0
    decode_timeout_s: float = 10.0
    #: Silence allowed before the decode worker's first chunk (without a prefill worker it computes the prompt).
    first_token_timeout_s: float = 120.0
    #: Silence allowed between two chunks of a running stream.
    stream_timeout_s: float = 5.0
    #: How often a waiting request checks heartbeats, silence and the client.
    poll_interval_s: float = 0.25
    #: Retry-After when the scheduler gives none.
    retry_after_s: float = 1.0


class GatewayHandler:
    """Runs requests on the workers over the bus; one per gateway process."""

    def __init__(
        self,
        bus: MessageBus,
        model: str,
        gateway_id: str,
        workers: WorkerTable,
        streams: TokenStreams,
        timeouts: GatewayTimeouts | None = None,
    ) -> None:
        self.bus = bus
        self.model = model
        self.gateway_id = gateway_id
        self.workers = workers
        self.streams = streams
        self.timeouts = timeouts or GatewayTimeouts()
        self._background: set[asyncio.Task[None]] = set()

    async def start(self, request: GenerateRequest) -> RunningRequest:
        """route → prefill (when the decision names a prefill worker) → decode; then stream the result."""
        block_hashes, fingerprint = self.workers.block_hashes(request.prompt_token_ids, request.cache_salt)
        decision = await self.route(request, block_hashes, fingerprint)
        prefill = await self.prefill(request, decision, block_hashes) if decision.prefill_worker_id else None
        stream = self.streams.open(request.request_id)  # before decode starts, so no chunk is missed
        try:
            if prefill is None or prefill.finish_reason is None:
                await self.decode(request, decision, prefill)
        except BaseException:
            stream.close()
            self.cancel_soon(request.request_id, "decode did not start")
            raise
        return RunningRequest(self, request, decision, prefill, stream)

    async def route(
        self, request: GenerateRequest, block_hashes: list[bytes], fingerprint: bytes | None
    ) -> RouteDecision:
        """Ask the scheduler for a (prefill, decode) pair; 503 when overloaded or no scheduler answers."""
        route_request = RouteRequest(
            request_id=request.request_id,
            gateway_id=self.gateway_id,
            block_hashes=block_hashes,
            num_prompt_tokens=len(request.prompt_token_ids),
            model_fingerprint=fingerprint,
        )
        try:
            decision = await self.bus.request(
                subjects.route(self.model), route_request, RouteDecision, self.timeouts.route_timeout_s
            )
        except NoResponders:
            raise overloaded("no scheduler is available", self.timeouts.retry_after_s) from None
        except BusError as exc:
            raise overloaded(f"the scheduler did not answer: {exc}", self.timeouts.retry_after_s) from None
        if decision.status is RouteStatus.OVERLOADED:
            raise overloaded("the server is overloaded", decision.retry_after_s or self.timeouts.retry_after_s)
        if decision.decode_worker_id is None:
            raise overloaded("no decode worker is available", self.timeouts.retry_after_s)
        return decision

    async def prefill(
        self, request: GenerateRequest, decision: RouteDecision, block_hashes: list[bytes]
    ) -> PrefillResult:
        """Prompt KV + first token on the prefill worker the scheduler picked."""
        worker_id = decision.prefill_worker_id
        assert worker_id is not None
        prefill_request = PrefillRequest(
            request_id=request.request_id,
            gateway_id=self.gateway_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            block_hashes=block_hashes,
        )
        try:
            result = await self._request_while_alive(
                subjects.prefill(self.model, worker_id), prefill_request, PrefillResult,
                self.timeouts.prefill_timeout_s, worker_id,
            )
        except BaseException:
            self.cancel_soon(request.request_id, "prefill failed")
            raise
        if result.error is not None:
            self.cancel_soon(request.request_id, "prefill failed")
            if any(word in result.error.lower() for word in _CLIENT_ERROR_WORDS):
                raise bad_request(f"prefill refused the request: {result.error}")
            raise ApiError(500, f"prefill failed: {result.error}", "server_error", None, "prefill_error")
        return result

    async def decode(
        self, request: GenerateRequest, decision: RouteDecision, prefill: PrefillResult | None
    ) -> None:
        """Hand the request (and the prefill's KV handle) to the decode worker; 503 if it refuses."""
        worker_id = decision.decode_worker_id
        assert worker_id is not None
        first_ids = [] if prefill is None or prefill.first_token_id is None else [prefill.first_token_id]
        decode_request = DecodeRequest(
            request_id=request.request_id,
            gateway_id=self.gateway_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=first_ids,
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            kv_handle=None if prefill is None else prefill.kv_handle,
            prefill_worker_id=decision.prefill_worker_id,
        )
        accepted = await self._request_while_alive(
            subjects.decode(self.model, worker_id), decode_request, DecodeAccepted,
            self.timeouts.decode_timeout_s, worker_id,
        )
        if not accepted.accepted:
            reason = accepted.reason or "no reason given"
            raise overloaded(f"decode worker refused the request: {reason}", self.timeouts.retry_after_s)

    async def _request_while_alive(
        self, subject: str, message: Message, response_type: type, timeout_s: float, worker_id: str
    ):
        """bus.request, given up early (503) when the worker's heartbeats stop while we wait."""
        task = asyncio.ensure_future(self.bus.request(subject, message, response_type, timeout_s))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.timeouts.poll_interval_s)
                if done:
                    return task.result()
                if self.workers.is_alive(worker_id) is False:
                    raise overloaded(f"worker {worker_id} stopped answering", self.timeouts.retry_after_s)
        except NoResponders:
            raise overloaded(f"worker {worker_id} is gone", self.timeouts.retry_after_s) from None
        except BusError as exc:
            raise overloaded(f"worker {worker_id} did not answer: {exc}", self.timeouts.retry_after_s) from None
        finally:
            if not task.done():
                task.cancel()

    def cancel_soon(self, request_id: str, reason: str) -> None:
        """Publish Cancel in the background (safe from a cancelled task or a closing generator)."""
        task = asyncio.get_running_loop().create_task(self._publish_cancel(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish_cancel(self, request_id: str, reason: str) -> None:
        try:
            await self.bus.publish(subjects.cancel(self.model), Cancel(request_id=request_id, reason=reason))
        except BusError as exc:
            logger.warning("could not publish Cancel for %s: %s", request_id, exc)

    async def drain(self) -> None:
        """Wait for background Cancel publishes (call before closing the bus)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


class RunningRequest:
    """A request the decode worker accepted (or the prefill already finished): its token chunks."""

    def __init__(
        self,
        handler: GatewayHandler,
        request: GenerateRequest,
        decision: RouteDecision,
        prefill: PrefillResult | None,
        stream: RequestStream,
    ) -> None:
        self.handler = handler
        self.request = request
        self.decision = decision
        self.prefill = prefill
        self.stream = stream
        self.finished = False

    @property
    def request_id(self) -> str:
        """The id the workers know this request by."""
        return self.request.request_id

    async def chunks(
        self, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[TokenChunk]:
        """The prefill's first token, then the decode worker's chunks, until one carries a finish_reason.

        Raises ApiError (502) when the worker fails, dies or goes silent. Leaving early (break, close) cancels.
        """
        try:
            if self.prefill is not None and (
                self.prefill.first_token_id is not None or self.prefill.finish_reason is not None
            ):
                first = _first_chunk(self.prefill)
                self.finished = first.finish_reason is not None
                yield first
                if self.finished:
                    return
            async for chunk in self._decoded(is_disconnected):
                yield chunk
        except ApiError as exc:
            self.stop(f"gateway gave up: {exc.message}")
            raise
        finally:
            self.stop("client disconnected")

    async def _decoded(self, is_disconnected: Callable[[], Awaitable[bool]] | None) -> AsyncIterator[TokenChunk]:
        timeouts = self.handler.timeouts
        worker_id = self.decision.decode_worker_id or ""
        silence_limit_s = timeouts.first_token_timeout_s
        last_chunk_s = last_check_s = time.monotonic()
        while True:
            chunk = await self.stream.get(timeouts.poll_interval_s)
            if is_disconnected is not None and time.monotonic() - last_check_s >= timeouts.poll_interval_s:
                last_check_s = time.monotonic()
                if await is_disconnected():
                    return
            if chunk is None:
                if self.handler.workers.is_alive(worker_id) is False:
                    raise upstream_failed(f"decode worker {worker_id} stopped sending heartbeats")
                if time.monotonic() - last_chunk_s > silence_limit_s:
                    raise upstream_failed(f"decode worker {worker_id} sent no tokens for {silence_limit_s:g} s")
                continue
            silence_limit_s = timeouts.stream_timeout_s
            last_chunk_s = time.monotonic()
            if chunk.error is not None or chunk.finish_reason is FinishReason.ERROR:
                self.finished = True  # the worker already dropped it
                raise upstream_failed(f"decode failed: {chunk.error or 'worker error'}")
            self.finished = chunk.finish_reason is not None
            yield chunk
            if self.finished:
                return

    def stop(self, reason: str) -> None:
        """End the request here; unless it already finished, Cancel tells the workers to drop it."""
        self.stream.close()
        if not self.finished:
            self.finished = True
            self.handler.cancel_soon(self.request_id, reason)


def _first_chunk(prefill: PrefillResult) -> TokenChunk:
    """The prefill worker's first token, as the first chunk of the stream."""
    return TokenChunk(
        request_id=prefill.request_id,
        token_ids=[] if prefill.first_token_id is None else [prefill.first_token_id],
        logprobs=None if prefill.first_logprobs is None else [prefill.first_logprobs],
        finish_reason=prefill.finish_reason,
        num_cached_tokens=prefill.num_cached_tokens,
    )
