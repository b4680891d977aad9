"""Scripted scheduler + prefill + decode responders on any MessageBus, for the gateway's tests (no model).

    workers = FakeWorkers(bus, "tiny", output_token_ids=[5, 6, 7])
    await workers.start()                    # route, prefill.prefill-0, decode.decode-0, cancel
    await workers.heartbeat()                # one WorkerLoad per worker, so the gateway sees them alive

Decode streams the script (cut at max_tokens) as one TokenBatch per step, `tokens_per_step` ids each, and stops
at once on Cancel. Behaviour switches (overloaded, refuse_decode, stall_after, ...) are plain attributes.
`worker_load(...)` builds a valid heartbeat for any test.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from deepinfer import subjects
from deepinfer.bus import IncomingMsg, MessageBus, Subscriptions
from deepinfer.protocol import (
    Cancel,
    DecodeAccepted,
    DecodeRequest,
    DecodeStatus,
    ErrorCode,
    ErrorDetail,
    FinishReason,
    PrefillRequest,
    PrefillResult,
    PromptLogprobs,
    RouteDecision,
    RouteRequest,
    RouteStatus,
    TokenBatch,
    TokenChunk,
    TokenLogprobs,
    WireSamplingParams,
    WorkerLoad,
    WorkerRole,
)
from deepinfer.tasks import BackgroundTasks

PREFILL_ID = "prefill-0"
DECODE_ID = "decode-0"


def worker_load(worker_id: str, role: WorkerRole, model: str = "m", **fields: Any) -> WorkerLoad:
    """A valid WorkerLoad heartbeat; `fields` override the defaults (a small decode-ready worker)."""
    defaults: dict[str, Any] = {
        "model_fingerprint": b"\x01" * 32,
        "layout_id": "layout",
        "block_size": 16,
        "max_num_seqs": 8,
        "max_model_len": 4096,
        "data_plane_address": "127.0.0.1:1",
        "internal_address": "127.0.0.1:2",
        "ts": time.time(),
    }
    return WorkerLoad(worker_id=worker_id, role=role, model=model, **{**defaults, **fields})


@dataclass
class FakeWorkers:
    """A scheduler, a prefill and a decode worker that follow a script; every message they got is recorded."""

    bus: MessageBus
    model: str
    output_token_ids: list[int]
    tokens_per_step: int = 2
    step_delay_s: float = 0.0
    #: How long the prefill worker takes before it answers.
    prefill_delay_s: float = 0.0
    #: Set: the prefill worker answers only once this event is set too (a test holds it: a prefill that has not
    #: answered for as long as the test says, however slow the machine).
    prefill_gate: asyncio.Event | None = None
    use_prefill: bool = True
    num_cached_tokens: int = 0
    overloaded: bool = False
    #: Set: decode refuses every request with this code.
    refuse_decode: ErrorCode | None = None
    #: Stop sending (without finishing) after this many output tokens: a silent stream.
    stall_after: int | None = None
    #: How many decode requests stall (stall_after); later ones (a migrated request's) run to the end.
    num_stalls: int | None = None
    #: The first decode request's chunk starting at this output position is never published (lost in transit).
    lose_chunk_at: int | None = None
    #: Leave this many route requests unanswered (a scheduler replica that died holding them).
    drop_routes: int = 0
    route_requests: list[RouteRequest] = field(default_factory=list)
    prefill_requests: list[PrefillRequest] = field(default_factory=list)
    decode_requests: list[DecodeRequest] = field(default_factory=list)
    cancels: list[Cancel] = field(default_factory=list)
    _subs: Subscriptions | None = None
    _tasks: BackgroundTasks = field(default_factory=lambda: BackgroundTasks("fake-workers"))

    async def start(self) -> None:
        """Register the responders."""
        model = self.model
        self._subs = subs = Subscriptions(self.bus)
        await subs.subscribe("route", subjects.route(model), self._route, queue=subjects.SCHEDULER_QUEUE,
                             message_type=RouteRequest)
        await subs.subscribe("prefill", subjects.prefill(model, PREFILL_ID), self._prefill,
                             message_type=PrefillRequest)
        await subs.subscribe("decode", subjects.decode(model, DECODE_ID), self._decode, message_type=DecodeRequest)
        await subs.subscribe("cancel", subjects.cancel(model), self._cancel, message_type=Cancel)
        flush = getattr(self.bus, "flush", None)
        if flush is not None:
            await flush()

    async def stop(self) -> None:
        """Unsubscribe and stop streaming."""
        if self._subs is not None:
            await self._subs.close()
        await self._tasks.drain(timeout_s=0.0)

    async def stop_scheduler(self) -> None:
        """Stop answering route requests only (a dead scheduler); the workers keep serving."""
        if self._subs is not None:
            await self._subs.unsubscribe("route")

    async def heartbeat(self, fingerprint: bytes = b"\x01" * 32) -> None:
        """One WorkerLoad from each worker."""
        for worker_id, role in ((PREFILL_ID, WorkerRole.PREFILL), (DECODE_ID, WorkerRole.DECODE)):
            load = worker_load(worker_id, role, self.model, model_fingerprint=fingerprint)
            await self.bus.publish(subjects.heartbeat(self.model, worker_id), load)

    def script(self, sampling: WireSamplingParams) -> tuple[list[int], FinishReason]:
        """The output for a request: the script cut at max_tokens (length) or whole (stop)."""
        ids = list(self.output_token_ids)
        if sampling.max_tokens is not None and len(ids) > sampling.max_tokens:
            return ids[: sampling.max_tokens], FinishReason.LENGTH
        return ids, FinishReason.STOP

    async def _route(self, request: RouteRequest, msg: IncomingMsg) -> None:
        self.route_requests.append(request)
        if len(self.route_requests) <= self.drop_routes:
            return
        decision = RouteDecision(
            request_id=request.request_id,
            status=RouteStatus.OVERLOADED if self.overloaded else RouteStatus.ACCEPTED,
            prefill_worker_id=PREFILL_ID if self.use_prefill and PREFILL_ID not in request.exclude_worker_ids else None,
            decode_worker_id=None if self.overloaded else DECODE_ID,
            retry_after_s=2.0 if self.overloaded else None,
            scheduler_id="scheduler-0",
        )
        await self.bus.reply(msg, decision)

    async def _prefill(self, request: PrefillRequest, msg: IncomingMsg) -> None:
        self.prefill_requests.append(request)
        await asyncio.sleep(self.prefill_delay_s)
        if self.prefill_gate is not None:
            await self.prefill_gate.wait()
        ids, finish = self.script(request.sampling)
        result = PrefillResult(
            request_id=request.request_id,
            first_token_id=ids[0],
            first_logprobs=_logprobs([ids[0]], request.sampling)[0] if request.sampling.logprobs is not None else None,
            num_cached_tokens=self.num_cached_tokens,
            finish_reason=finish if len(ids) == 1 else None,
            prompt_logprobs=fake_prompt_logprobs(request.prompt_token_ids, request.sampling),
        )
        await self.bus.reply(msg, result)

    async def _decode(self, request: DecodeRequest, msg: IncomingMsg) -> None:
        self.decode_requests.append(request)
        if self.refuse_decode is not None:
            error = ErrorDetail(code=self.refuse_decode, message=f"refused ({self.refuse_decode.value})")
            await self.bus.reply(msg, DecodeAccepted(request_id=request.request_id, status=DecodeStatus.REFUSED,
                                                     error=error))
            return
        await self.bus.reply(msg, DecodeAccepted(request_id=request.request_id, status=DecodeStatus.ACCEPTED))
        self._tasks.spawn(self._stream(request))

    async def _stream(self, request: DecodeRequest) -> None:
        ids, finish = self.script(request.sampling)
        stall_after = self.stall_after
        if self.num_stalls is not None and len(self.decode_requests) > self.num_stalls:
            stall_after = None
        position = len(request.output_token_ids)
        step = 0
        first = True
        while position < len(ids):
            if any(c.request_id == request.request_id for c in self.cancels):
                return
            if stall_after is not None and position >= stall_after:
                return
            await asyncio.sleep(self.step_delay_s)
            new_ids = ids[position : position + self.tokens_per_step]
            previous, position = position, position + len(new_ids)
            chunk = TokenChunk(
                request_id=request.request_id,
                token_ids=new_ids,
                logprobs=_logprobs(new_ids, request.sampling) if request.sampling.logprobs is not None else None,
                finish_reason=finish if position >= len(ids) else None,
                num_cached_tokens=self.num_cached_tokens if first else None,
                num_previous_tokens=previous,
                # the prompt is computed here only when no token came with the request
                prompt_logprobs=fake_prompt_logprobs(request.prompt_token_ids, request.sampling)
                if first and not request.output_token_ids else None,
            )
            first = False
            batch = TokenBatch(worker_id=DECODE_ID, step=step, chunks=[chunk])
            step += 1
            if previous == self.lose_chunk_at and request is self.decode_requests[0]:
                continue
            await self.bus.publish(subjects.tokens(self.model, request.gateway_id), batch)

    async def _cancel(self, cancel: Cancel, msg: IncomingMsg) -> None:
        self.cancels.append(cancel)


def fake_prompt_logprobs(prompt_token_ids: list[int], sampling: WireSamplingParams) -> PromptLogprobs | None:
    """Deterministic prompt scores when asked: position i (1..P-1) at -i/8 with rank k + 1, the `prompt_logprobs` = k
    alternatives ids 1..k at -1/32, -2/32, ... (more likely, so a prompt of ids above k never is among them)."""
    k = sampling.prompt_logprobs
    if k is None:
        return None
    positions = range(1, len(prompt_token_ids))
    return PromptLogprobs(
        logprobs=[-i / 8 for i in positions],
        ranks=[k + 1 for _ in positions],
        top_token_ids=[list(range(1, k + 1)) for _ in positions],
        top_logprobs=[[-j / 32 for j in range(1, k + 1)] for _ in positions],
    )


def _logprobs(token_ids: list[int], sampling: WireSamplingParams) -> list[TokenLogprobs]:
    """Deterministic logprobs: the sampled id at -0.5, then `logprobs` alternatives at -1, -2, ..."""
    k = sampling.logprobs or 0
    return [
        TokenLogprobs(token_id=t, logprob=-0.5, top=[(t, -0.5)] + [(t + i, -1.0 * i) for i in range(1, k)])
        for t in token_ids
    ]
