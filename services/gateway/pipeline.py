"""The request pipeline on the workers' side: receive → route → prefill → decode → stream tokens.

    running = await pipeline.start(request)         # route, prefill, decode: any failure here is an ApiError
    async for chunk in running.chunks():            # TokenChunks until finish_reason, or an ApiError
        ...
    running.stop("stop string")                     # ends it early: Cancel tells every worker to drop it

Failures before the first token are 503s (retryable: the scheduler picks another worker on the retry) unless a
worker says the request itself is bad (its ErrorCode decides, through `errors.HTTP_ERRORS`); failures after
are 502s, or an error event for a stream that already started. A worker that stops heartbeating or a stream
that goes silent ends the request within `stream_timeout_s` / the heartbeat lease, never a hang; a request
past its deadline (`request_timeout_s`) ends with a 504 and a Cancel to every worker. With migration on (the
default) a worker lost before the first token is retried on another, and one lost mid-stream is resumed there
(`running.py`), within `migration_budget` re-issues; the errors above are what is left when the budget runs out.
When no scheduler answers (none subscribed, or every route attempt timed out), the gateway routes the request
itself from its heartbeat table (`fallback_routing.py`, `route_fallback`): a router restart fails no request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import TypeVar

from deepinfer import subjects
from deepinfer.bus import BusError, BusTimeout, MessageBus, NoResponders, PayloadTooLarge
from deepinfer.config import GatewaySettings
from deepinfer.hashing import hash_blocks
from deepinfer.membership import Membership
from deepinfer.protocol import (
    Cancel,
    DecodeAccepted,
    DecodeRequest,
    DecodeStatus,
    ErrorCode,
    KvHandle,
    Message,
    PrefillRequest,
    PrefillResult,
    RouteDecision,
    RouteRequest,
    RouteStatus,
)
from deepinfer.tasks import BackgroundTasks
from deepinfer.telemetry.hops import Hops
from services.gateway.errors import ApiError, client_gone, from_wire, overloaded, timed_out
from services.gateway.fallback_routing import FallbackRouter
from services.gateway.recipe import GenerateRequest
from services.gateway.running import REISSUE_CODES, RunningRequest, attempt_id
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
        on_reissue: Callable[[str], None] = lambda kind: None,
        on_fallback_route: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.bus = bus
        self.hops = hops
        self.settings = settings
        self.model = model
        self.gateway_id = settings.gateway_id
        self.membership = membership
        self.streams = streams
        self.tasks = BackgroundTasks("gateway")
        #: Requests streaming now (shutdown aborts them); set when shutting down past the drain grace.
        self.running: set[RunningRequest] = set()
        self.closing = False
        #: Called per re-issue with its kind ("start": a prefill or admission retried, "migration": mid-stream).
        self.on_reissue = on_reissue
        #: Routes requests while no scheduler answers (None: route_fallback off, those requests get a 503).
        self.fallback = FallbackRouter(membership, self.gateway_id) if settings.route_fallback else None
        #: Called per request routed by `fallback`, with why no scheduler did (no_scheduler, timeout, error).
        self.on_fallback_route = on_fallback_route

    async def start(self, request: GenerateRequest) -> RunningRequest:
        """route → prefill (when the decision names a prefill worker) → decode; then stream the result. A prefill
        or decode worker lost (or refusing: full, draining) before the decode started is retried elsewhere, within
        the migration budget."""
        block_hashes, fingerprint = self.block_hashes(request)
        exclude: list[str] = []
        num_reissues = 0
        while True:
            attempt = dataclasses.replace(request, request_id=attempt_id(request.request_id, num_reissues))
            failed_worker: list[str] = []
            try:
                return await self._start_once(attempt, block_hashes, fingerprint, exclude, num_reissues,
                                              failed_worker)
            except ApiError as exc:
                if not (self._may_reissue(exc, num_reissues, request) and failed_worker):
                    raise
            exclude.extend(failed_worker)
            num_reissues += 1
            self.on_reissue("start")

    async def _start_once(
        self, request: GenerateRequest, block_hashes: list[bytes], fingerprint: bytes | None, exclude: list[str],
        num_reissues: int, failed_worker: list[str],
    ) -> RunningRequest:
        with self.hops.span("route"):
            decision = await self.route(request, block_hashes, fingerprint, exclude)
        prefill = None
        if decision.prefill_worker_id:
            failed_worker[:] = [decision.prefill_worker_id]
            with self.hops.span("prefill", worker_id=decision.prefill_worker_id):
                prefill = await self.prefill(request, decision, block_hashes)
        first_ids = [] if prefill is None or prefill.first_token_id is None else [prefill.first_token_id]
        stream = self.streams.open(request.request_id, len(first_ids))  # before decode starts: no chunk missed
        try:
            if prefill is None or prefill.finish_reason is None:
                worker_id = decision.decode_worker_id
                assert worker_id is not None
                failed_worker[:] = [worker_id]
                with self.hops.span("decode_admission", worker_id=worker_id):
                    await self.decode(request, worker_id, first_ids, None if prefill is None else prefill.kv_handle,
                                      decision.prefill_worker_id)
        except BaseException:
            stream.close()
            self.cancel_soon(request.request_id, "decode did not start")
            raise
        return RunningRequest(self, request, decision, prefill, stream, num_reissues)

    def _may_reissue(self, exc: ApiError, num_reissues: int, request: GenerateRequest) -> bool:
        """Whether a failure before the first token may be retried on another worker."""
        return (
            self.settings.migration
            and not self.closing
            and exc.error_code in REISSUE_CODES
            and num_reissues < self.settings.migration_budget
            and time.monotonic() < request.deadline_s
        )

    async def resume(
        self, request: GenerateRequest, request_id: str, output_token_ids: list[int], exclude: list[str]
    ) -> tuple[RouteDecision, RequestStream]:
        """Re-issue `request` as `request_id` with the tokens already sent, straight to a decode worker (it computes
        prompt + those tokens itself: a prefill worker would sample the next token without knowing they are
        output); returns the decision and the new attempt's open stream."""
        attempt = dataclasses.replace(request, request_id=request_id)
        block_hashes, fingerprint = self.block_hashes(request)
        decision = await self.route(attempt, block_hashes, fingerprint, exclude, len(output_token_ids))
        worker_id = decision.decode_worker_id
        assert worker_id is not None
        stream = self.streams.open(request_id, len(output_token_ids))
        try:
            await self.decode(attempt, worker_id, list(output_token_ids), None, None)
        except BaseException:
            stream.close()
            self.cancel_soon(request_id, "resumed decode did not start")
            raise
        self.on_reissue("migration")
        return decision, stream

    def abort_all(self, error: ApiError) -> int:
        """Shutdown past the drain grace: every running request ends with `error` (no re-issue from now on);
        returns how many were running."""
        self.closing = True
        running = list(self.running)
        for run in running:
            run.abort(error)
        return len(running)

    def block_hashes(self, request: GenerateRequest) -> tuple[list[bytes], bytes | None]:
        """(hashes of the prompt's full blocks, the fingerprint used), from the latest heartbeat; none before."""
        latest = self.membership.latest()
        if latest is None:
            return [], None
        fingerprint = latest.model_fingerprint
        return hash_blocks(request.prompt_token_ids, latest.block_size, fingerprint, request.cache_salt), fingerprint

    async def route(
        self, request: GenerateRequest, block_hashes: list[bytes], fingerprint: bytes | None,
        exclude: list[str] | None = None, num_output_tokens: int = 0,
    ) -> RouteDecision:
        """Ask the scheduler for a (prefill, decode) pair, avoiding `exclude` if it can; 503 when overloaded or no
        scheduler answers."""
        route_request = RouteRequest(
            request_id=request.request_id,
            gateway_id=self.gateway_id,
            block_hashes=block_hashes,
            num_prompt_tokens=len(request.prompt_token_ids) + num_output_tokens,
            model_fingerprint=fingerprint,
            exclude_worker_ids=exclude or [],
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
                decision = self._route_without_scheduler(route_request, "no_scheduler", "no scheduler is available")
                break
            except BusTimeout as exc:  # the replica that got it may have died: another one answers the retry
                if attempt + 1 < ROUTE_ATTEMPTS:
                    continue
                self._check_deadline(request)
                decision = self._route_without_scheduler(route_request, "timeout",
                                                         f"the scheduler did not answer: {exc}")
            except BusError as exc:
                self._check_deadline(request)
                decision = self._route_without_scheduler(route_request, "error", f"the scheduler did not answer: {exc}")
                break
        if decision.status is RouteStatus.OVERLOADED:
            raise overloaded("the server is overloaded", decision.retry_after_s or retry_after_s)
        if decision.decode_worker_id is None:
            raise overloaded("no decode worker is available", retry_after_s)
        return decision

    def _route_without_scheduler(self, route_request: RouteRequest, reason: str, why: str) -> RouteDecision:
        """No scheduler answered: this gateway's own least-loaded pick (fail-open, `route_fallback`), else 503."""
        if self.fallback is None:
            raise overloaded(why, self.settings.retry_after_s)
        decision = self.fallback.route(route_request)
        if decision.decode_worker_id is None:
            raise overloaded(f"{why}, and no decode worker is alive", self.settings.retry_after_s)
        self.on_fallback_route(reason)
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
        self, request: GenerateRequest, worker_id: str, output_token_ids: list[int], kv_handle: KvHandle | None,
        prefill_worker_id: str | None,
    ) -> None:
        """Hand the request (with the tokens already generated, and the prefill's KV handle if any) to the decode
        worker; its refusal's code decides. Prompt logprobs are asked of the worker that computes the prompt: of
        this one only when no token came before (no prefill worker ran, nothing was sent before a migration)."""
        sampling = request.sampling
        if output_token_ids and sampling.prompt_logprobs is not None:
            sampling = sampling.model_copy(update={"prompt_logprobs": None})
        decode_request = DecodeRequest(
            request_id=request.request_id,
            gateway_id=self.gateway_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=output_token_ids,
            sampling=sampling,
            cache_salt=request.cache_salt,
            kv_handle=kv_handle,
            prefill_worker_id=prefill_worker_id,
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
                if self.closing:
                    raise overloaded("the server is shutting down", retry_after_s)
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


def _too_large_to_forward(exc: PayloadTooLarge) -> ApiError:
    """413 for a request whose message to the workers would not fit the bus (no subject named: internal)."""
    return ApiError(
        ErrorCode.PAYLOAD_TOO_LARGE,
        f"the request is too large to forward to the workers ({exc.size_bytes} bytes, over {exc.max_bytes})",
    )
