"""The request pipeline on the workers' side: receive → route → prefill → decode → stream tokens.

    running = await pipeline.start(request)         # route, prefill, decode: any failure here is an ApiError
    async for chunk in running.chunks():            # TokenChunks until finish_reason, or an ApiError
        ...
    running.stop("stop string")                     # ends it early: Cancel tells every worker to drop it

Failures before the first token are 503s (retryable: the scheduler picks another worker on the retry) unless a
worker says the request itself is bad (its ErrorCode decides, through `errors.HTTP_ERRORS`); failures after
are 502s, or an error event for a stream that already started. A worker that stops heartbeating or a stream
that goes silent ends the request within `stream_timeout_s` / the heartbeat lease, never a hang; a request
past its deadline (`request_timeout_s`) ends with a 504 and a Cancel to every worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TypeVar

from deepinfer import subjects
from deepinfer.bus import BusError, BusTimeout, MessageBus, NoResponders, PayloadTooLarge
from deepinfer.config import GatewaySettings
from deepinfer.kvcache.hashing import hash_blocks
from deepinfer.membership import Membership
from deepinfer.protocol import (
    Cancel,
    DecodeAccepted,
    DecodeRequest,
    DecodeStatus,
    ErrorCode,
    FinishReason,
    Message,
    PrefillRequest,
    PrefillResult,
    RouteDecision,
    RouteRequest,
    RouteStatus,
    TokenChunk,
)
from deepinfer.tasks import BackgroundTasks
from deepinfer.telemetry.hops import Hops
from services.gateway.errors import ApiError, client_gone, from_wire, overloaded, timed_out, worker_lost
from services.gateway.recipe import GenerateRequest
from services.gateway.streams import RequestStream, TokenStreams

M = TypeVar("M", bound=Message)

#: Route requests per request: a scheduler replica killed while holding one leaves it unanswered; the queue
#: group gives the retry to a live replica (each attempt waits route_timeout_s at most).
ROUTE_ATTEMPTS = 2


class RequestPipeline:
    """Runs requests on the workers over the bus; one per gateway process."""

    def __init__(
        self,
        bus: MessageBus,
        settings: GatewaySettings,
        model: str,
        membership: Membership,
        streams: TokenStreams,
        hops: Hops,
    ) -> None:
        self.bus = bus
        self.hops = hops
        self.settings = settings
        self.model = model
        self.gateway_id = settings.gateway_id
        self.membership = membership
        self.streams = streams
        self.tasks = BackgroundTasks("gateway")

    async def start(self, request: GenerateRequest) -> RunningRequest:
        """route → prefill (when the decision names a prefill worker) → decode; then stream the result."""
        block_hashes, fingerprint = self.block_hashes(request)
        with self.hops.span("route"):
            decision = await self.route(request, block_hashes, fingerprint)
        prefill = None
        if decision.prefill_worker_id:
            with self.hops.span("prefill", worker_id=decision.prefill_worker_id):
                prefill = await self.prefill(request, decision, block_hashes)
        stream = self.streams.open(request.request_id)  # before decode starts, so no chunk is missed
        try:
            if prefill is None or prefill.finish_reason is None:
                with self.hops.span("decode_admission", worker_id=decision.decode_worker_id or ""):
                    await self.decode(request, decision, prefill)
        except BaseException:
            stream.close()
            self.cancel_soon(request.request_id, "decode did not start")
            raise
        return RunningRequest(self, request, decision, prefill, stream)

    def block_hashes(self, request: GenerateRequest) -> tuple[list[bytes], bytes | None]:
        """(hashes of the prompt's full blocks, the fingerprint used), from the latest heartbeat; none before."""
        latest = self.membership.latest()
        if latest is None:
            return [], None
        fingerprint = latest.model_fingerprint
        return hash_blocks(request.prompt_token_ids, latest.block_size, fingerprint, request.cache_salt), fingerprint

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
        retry_after_s = self.settings.retry_after_s
        for attempt in range(ROUTE_ATTEMPTS):
            timeout_s = self._hop_timeout_s(request, self.settings.route_timeout_s)
            try:
                decision = await self.bus.request(subjects.route(self.model), route_request, RouteDecision, timeout_s)
                break
            except PayloadTooLarge as exc:
                raise _too_large_to_forward(exc) from None
            except NoResponders:
                raise overloaded("no scheduler is available", retry_after_s) from None
            except BusTimeout as exc:  # the replica that got it may have died: another one answers the retry
                if attempt + 1 < ROUTE_ATTEMPTS:
                    continue
                self._check_deadline(request)
                raise overloaded(f"the scheduler did not answer: {exc}", retry_after_s) from None
            except BusError as exc:
                self._check_deadline(request)
                raise overloaded(f"the scheduler did not answer: {exc}", retry_after_s) from None
        if decision.status is RouteStatus.OVERLOADED:
            raise overloaded("the server is overloaded", decision.retry_after_s or retry_after_s)
        if decision.decode_worker_id is None:
            raise overloaded("no decode worker is available", retry_after_s)
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
                request, subjects.prefill(self.model, worker_id), prefill_request, PrefillResult,
                self.settings.prefill_timeout_s, worker_id,
            )
        except BaseException:
            self.cancel_soon(request.request_id, "prefill failed")
            raise
        if result.error is not None:
            self.cancel_soon(request.request_id, "prefill failed")
            raise from_wire(result.error, f"prefill worker {worker_id}", self.settings.retry_after_s)
        return result

    async def decode(
        self, request: GenerateRequest, decision: RouteDecision, prefill: PrefillResult | None
    ) -> None:
        """Hand the request (and the prefill's KV handle) to the decode worker; its refusal's code decides."""
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
            request, subjects.decode(self.model, worker_id), decode_request, DecodeAccepted,
            self.settings.decode_timeout_s, worker_id,
        )
        if accepted.status is DecodeStatus.REFUSED:
            assert accepted.error is not None  # the message's validator guarantees it
            raise from_wire(accepted.error, f"decode worker {worker_id} refused the request",
                            self.settings.retry_after_s)

    async def _request_while_alive(
        self, request: GenerateRequest, subject: str, message: Message, response_type: type[M],
        timeout_s: float, worker_id: str,
    ) -> M:
        """bus.request, given up early (503) when the worker's heartbeats stop, or (504) at the deadline."""
        retry_after_s = self.settings.retry_after_s
        task = asyncio.ensure_future(
            self.bus.request(subject, message, response_type, self._hop_timeout_s(request, timeout_s))
        )
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.settings.poll_interval_s)
                if done:
                    return task.result()
                self._check_deadline(request)
                if request.is_disconnected is not None and await request.is_disconnected():
                    raise client_gone()  # the caller's Cancel reaches the worker: a long prefill stops
                if self.membership.is_alive(worker_id) is False:
                    raise overloaded(f"worker {worker_id} stopped answering", retry_after_s)
        except PayloadTooLarge as exc:
            raise _too_large_to_forward(exc) from None
        except NoResponders:
            raise overloaded(f"worker {worker_id} is gone", retry_after_s) from None
        except BusError as exc:
            self._check_deadline(request)
            raise overloaded(f"worker {worker_id} did not answer: {exc}", retry_after_s) from None
        finally:
            if not task.done():
                task.cancel()

    def _hop_timeout_s(self, request: GenerateRequest, timeout_s: float) -> float:
        """A hop's own timeout, cut to what is left of the request's deadline (504 when nothing is)."""
        self._check_deadline(request)
        return min(timeout_s, request.deadline_s - time.monotonic())

    def _check_deadline(self, request: GenerateRequest) -> None:
        if time.monotonic() >= request.deadline_s:
            raise timed_out(self.settings.request_timeout_s)

    def cancel_soon(self, request_id: str, reason: str) -> None:
        """Publish Cancel in the background (safe from a cancelled task or a closing generator)."""
        cancel = Cancel(request_id=request_id, reason=reason)
        self.tasks.spawn(self.bus.publish(subjects.cancel(self.model), cancel), name=f"cancel-{request_id}")


class RunningRequest:
    """A request the decode worker accepted (or the prefill already finished): its token chunks."""

    def __init__(
        self,
        pipeline: RequestPipeline,
        request: GenerateRequest,
        decision: RouteDecision,
        prefill: PrefillResult | None,
        stream: RequestStream,
    ) -> None:
        self.pipeline = pipeline
        self.request = request
        self.decision = decision
        self.prefill = prefill
        self.stream = stream
        self.finished = False

    @property
    def request_id(self) -> str:
        """The id the workers know this request by."""
        return self.request.request_id

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        """The prefill's first token, then the decode worker's chunks, until one carries a finish_reason.

        Raises ApiError when the worker fails, dies or goes silent (502) or the deadline passes (504).
        Leaving early (break, close) cancels.
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
            async for chunk in self._decoded():
                yield chunk
        except ApiError as exc:
            self.stop(f"gateway gave up: {exc.message}")
            raise
        finally:
            self.stop("client disconnected")

    async def _decoded(self) -> AsyncIterator[TokenChunk]:
        settings, is_disconnected = self.pipeline.settings, self.request.is_disconnected
        worker_id = self.decision.decode_worker_id or ""
        silence_limit_s = settings.first_token_timeout_s
        last_chunk_s = last_check_s = time.monotonic()
        while True:
            left_s = self.request.deadline_s - time.monotonic()
            if left_s <= 0:
                raise timed_out(settings.request_timeout_s)
            chunk = await self.stream.get(min(settings.poll_interval_s, left_s))
            if is_disconnected is not None and time.monotonic() - last_check_s >= settings.poll_interval_s:
                last_check_s = time.monotonic()
                if await is_disconnected():
                    return
            if chunk is None:
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

    def stop(self, reason: str) -> None:
        """End the request here; unless it already finished, Cancel tells the workers to drop it."""
        self.stream.close()
        if not self.finished:
            self.finished = True
            self.pipeline.cancel_soon(self.request_id, reason)


def _too_large_to_forward(exc: PayloadTooLarge) -> ApiError:
    """413 for a request whose message to the workers would not fit the bus (no subject named: internal)."""
    return ApiError(
        ErrorCode.PAYLOAD_TOO_LARGE,
        f"the request is too large to forward to the workers ({exc.size_bytes} bytes, over {exc.max_bytes})",
    )


def _first_chunk(prefill: PrefillResult) -> TokenChunk:
    """The prefill worker's first token, as the first chunk of the stream."""
    return TokenChunk(
        request_id=prefill.request_id,
        token_ids=[] if prefill.first_token_id is None else [prefill.first_token_id],
        logprobs=None if prefill.first_logprobs is None else [prefill.first_logprobs],
        finish_reason=prefill.finish_reason,
        num_cached_tokens=prefill.num_cached_tokens,
        cached_tokens_by_tier=prefill.cached_tokens_by_tier or None,
    )
