"""The decode worker. Per DecodeRequest on `decode(model, worker_id)`:

    receive → pull the prompt's KV by handle (device to device on one host; else through the owner's transfer engine
    when kv_transport takes it, falling back to the data-plane get) → Release to the prefill worker
    → join the running batch → reply DecodeAccepted
    → every engine step: one TokenBatch per gateway with the new tokens of its requests (diffs); a request that
      asked for prompt_logprobs and whose prompt was computed here gets them on its first chunk

A handle whose layout differs from ours is refused (LAYOUT_MISMATCH), as is an invalid request (BAD_REQUEST,
CONTEXT_LENGTH) or any request while draining (OVERLOADED); an expired lease or a failed pull recomputes the
prompt here instead of failing the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import Counter

from deepinfer import subjects
from deepinfer.bus import IncomingMsg, Subscriptions
from deepinfer.config import DecodeSettings
from deepinfer.dataplane import (
    DataPlaneClient,
    DataPlaneConnectionError,
    DataPlaneError,
    LayoutMismatch,
    LeaseExpired,
    check_layout,
)
from deepinfer.dataplane.frames import BytesLike
from deepinfer.dataplane.transfer_engine import TransferEngineUnavailable
from deepinfer.engine import (
    COMPUTE,
    Abort,
    AddRequest,
    Admission,
    EngineOutput,
    EngineRequest,
    KvSource,
    PeerDeviceKv,
    PulledKv,
)
from deepinfer.host_identity import host_id as this_host_id
from deepinfer.kvcache.client import KvTransport
from deepinfer.kvcache.client.remote import TransferEngineReads
from deepinfer.kvcache.client.transport import handoff_path
from deepinfer.protocol import (
    Cancel,
    DecodeAccepted,
    DecodeRequest,
    DecodeStatus,
    ErrorCode,
    ErrorDetail,
    FinishReason,
    KvHandle,
    Release,
    TokenBatch,
    TokenBatchWriter,
    TokenChunk,
    TokenLogprobs,
    WorkerRole,
    chunk_prefix,
)
from deepinfer.protocol.token_wire import PACKED_COUNTS, STEADY_MIDDLE, num_chunks
from deepinfer.sampling.params import SamplingParams
from deepinfer.service import ServiceContext
from deepinfer.telemetry import counter
from deepinfer.telemetry.hops import TokenSpans
from deepinfer.worker.errors import error_detail
from deepinfer.worker.prompt_logprobs import wire_prompt_logprobs
from deepinfer.worker.runtime import WorkerRuntime
from deepinfer.worker.settings import engine_sampling
from deepinfer.worker.store_tier import cached_tokens_by_tier

log = logging.getLogger(__name__)

#: Past the drain grace: time left for the abort's error chunks to leave before the bus closes.
ABORT_FLUSH_S = 1.0
#: Gateways whose token subject is kept built (more: the cache starts again).
MAX_CACHED_SUBJECTS = 256


@dataclass(slots=True)
class _Stream:
    """Where a running request's tokens go (slotted: the per-step loop reads it once per output)."""

    gateway_id: str
    want_logprobs: bool
    #: The bytes its every TokenChunk starts with (`chunk_prefix`).
    prefix: bytes
    #: Its gateway's batch of the step in progress (`DecodeHandler._batch_pieces`): its chunks go there.
    pieces: list[bytes]
    sent_first: bool = False
    #: Its chunks are steady now (`TokenBatchWriter.add_steady`): the first went, no logprobs (until the last).
    steady: bool = False
    #: Output tokens of the request so far (those it came with included): each chunk's num_previous_tokens.
    num_tokens: int = 0
    #: When the request is traced: which of its token batches become spans, and their parent; else None.
    token_spans: TokenSpans | None = None


class DecodeHandler:
    """Token generation for one model; a `deepinfer.service.Handler`."""

    def __init__(self, ctx: ServiceContext[DecodeSettings]) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.bus = ctx.bus
        self.runtime = WorkerRuntime(ctx.settings, WorkerRole.DECODE, ctx.bus, ctx.registry, ctx.tracer)
        self.runtime.on_outputs = self._on_outputs
        self.runtime.on_cancel = self._on_cancel
        self._streams: dict[str, _Stream] = {}
        self._clients: dict[str, DataPlaneClient] = {}
        self._tasks = self.runtime.tasks
        self._subscriptions = Subscriptions(ctx.bus)
        self._step = 0
        self._writer = TokenBatchWriter(self.runtime.worker_id)
        #: tokens(model, gateway_id) by gateway id: built once, not per step.
        self._token_subjects: dict[str, str] = {}
        #: Each gateway's batch of the step in progress, by gateway id: one list per gateway, kept from step to step
        #: (emptied as each step starts) and held by its streams, so a chunk goes to it without a lookup.
        self._batches: dict[str, list[bytes]] = {}
        #: (gateway id, batch) of the step's chunks that go alone: those carrying prompt logprobs.
        self._solo: list[tuple[str, list[bytes]]] = []
        self._requests = counter(ctx.registry, "decode_requests", "Decode requests by how their KV arrived.",
                                 ["kv"])
        self._admitted: dict[str, Counter] = {}
        #: Pulls through the owner's transfer engine (kv_transport, handoff_path); the engine starts at the first.
        self._transport = KvTransport(ctx.settings.kv_transport)
        self._handoff_reads = TransferEngineReads(ctx.settings.data_plane_host)
        self._host_id = this_host_id()
        self._transfer_engine_error = ""  # set once when the library does not load here: the data plane from then
        self._pulls = counter(ctx.registry, "decode_kv_pulls", "Pulls of a prefill worker's KV by the path that "
                              "served them (transfer_engine_fallback: the engine failed, the data plane served).",
                              ["via"])

    # -- lifecycle ----------------------------------------------------------------------------------------------
    async def load(self) -> None:
        """Load the model."""
        await self.runtime.load()

    async def start(self) -> None:
        """Take decode requests; start heartbeats."""
        model, worker_id = self.runtime.model, self.runtime.worker_id
        await self._subscriptions.subscribe(
            "decode", subjects.decode(model, worker_id), self._on_decode, message_type=DecodeRequest
        )
        await self.runtime.start(self.ctx.internal_address, "")

    def is_ready(self) -> bool:
        """Model loaded and registered."""
        return self.runtime.is_ready()

    @property
    def num_streams(self) -> int:
        """Requests whose tokens this worker still streams to a gateway."""
        return len(self._streams)

    def not_ready_reason(self) -> str:
        """Why not ready."""
        return self.runtime.not_ready_reason()

    def unhealthy_reason(self) -> str:
        """Why /health fails ("" when healthy): the engine failed or a step is stuck."""
        return self.runtime.unhealthy_reason()

    async def drain(self, grace_s: float) -> None:
        """Stop taking requests; finish the running batch and publish its last tokens, within grace_s. Past it,
        abort what is left and tell each request's gateway (an OVERLOADED error chunk: it resumes the request on
        another worker, or ends it cleanly)."""
        await self.runtime.drain()
        await self._subscriptions.unsubscribe("decode")
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            await self._abort_held(f"decode worker {self.runtime.worker_id} shut down past its drain grace")
        await self.runtime.flush(max(deadline - time.monotonic(), ABORT_FLUSH_S))

    async def _abort_held(self, reason: str) -> None:
        """Abort every request still held (engine blocks freed) and send each one's gateway an error chunk."""
        streams, self._streams = self._streams, {}
        error = ErrorDetail(code=ErrorCode.OVERLOADED, message=reason)
        by_gateway: dict[str, list[TokenChunk]] = {}
        for request_id, stream in streams.items():
            chunk = TokenChunk(request_id=request_id, token_ids=[], finish_reason=FinishReason.ERROR, error=error)
            by_gateway.setdefault(stream.gateway_id, []).append(chunk)
        log.warning("aborting %d request(s): %s", len(streams), reason)
        for gateway_id, chunks in by_gateway.items():
            batch = TokenBatch(worker_id=self.runtime.worker_id, step=self._step + 1, chunks=chunks)
            self._tasks.spawn(self.bus.publish(subjects.tokens(self.runtime.model, gateway_id), batch))
        if self.runtime.engine_loop is not None:
            with contextlib.suppress(Exception):
                await self.runtime.run(Abort(list(streams)))

    async def close(self) -> None:
        """Stop the engine and close data-plane connections."""
        await self._subscriptions.close()
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        await self.runtime.close()
        self._handoff_reads.close()
        if self.runtime.engine is not None:
            self.runtime.engine.close_peers()

    # -- the loop -----------------------------------------------------------------------------------------------
    async def _on_decode(self, request: DecodeRequest, msg: IncomingMsg) -> None:
        """receive → pull → release → admit → reply, on its own task."""
        request_id = request.request_id

        def on_failure(error: ErrorDetail) -> DecodeAccepted:
            self._streams.pop(request_id, None)
            return _refused(request_id, error)

        self.runtime.reply_in_background(msg, request_id, "admission", lambda: self.decode(request), on_failure)

    async def decode(self, request: DecodeRequest) -> DecodeAccepted:
        """Admit one request into the running batch (pulling its KV when a handle came with it)."""
        request_id = request.request_id
        if self.runtime.draining:
            return _refused(request_id, ErrorDetail(code=ErrorCode.OVERLOADED, message="draining"))
        try:
            params = engine_sampling(request.sampling)
        except ValueError as exc:
            return _refused(request_id, error_detail(exc, "invalid sampling"))
        handle = request.kv_handle
        if handle is not None:
            try:
                check_layout(handle, self.runtime.layout)
            except LayoutMismatch as exc:
                return _refused(request_id, ErrorDetail(code=ErrorCode.LAYOUT_MISMATCH, message=str(exc)))
        engine = self.runtime.engine
        on_device = handle is not None and engine is not None and engine.accepts_device_kv(handle)
        traced = trace.get_current_span().is_recording()
        self._streams[request_id] = _Stream(request.gateway_id, params.logprobs is not None, chunk_prefix(request_id),
                                            self._batch_pieces(request.gateway_id),
                                            token_spans=self.runtime.hops.token_spans(otel_context.get_current())
                                            if traced else None,
                                            num_tokens=len(request.output_token_ids))
        try:
            admission = None
            if on_device:
                with self.runtime.hops.span("kv_transfer", via="device"):
                    admission = await self._admit_on_device(request, params)
            if admission is None:
                kv: KvSource = COMPUTE
                if handle is not None and engine is not None and not engine.takes_kv:
                    self._release(handle)  # KV by layer type: computed here, so not pulled; the owner frees it now
                elif handle is not None:
                    via = "data_plane" if self._handoff_path(handle) == "dataplane" else "transfer_engine"
                    with self.runtime.hops.span("kv_transfer", via=via, num_blocks=len(handle.block_ids)):
                        payloads = await self._pull(handle)
                    kv = COMPUTE if payloads is None else PulledKv(payloads)
                # Pulled KV with no free block right now, no handle, a failed pull: the prompt is computed here.
                admission = await self.runtime.add_request(_engine_request(request, params, kv))
        except ValueError as exc:
            self._streams.pop(request_id, None)
            return _refused(request_id, error_detail(exc, "invalid request"))
        kv_label = admission.kv if admission.kv in ("pulled", "device") else (
            "recomputed" if handle is not None else "local")
        admitted = self._admitted.get(kv_label)
        if admitted is None:  # `labels` takes a lock and builds its key each call: once per kind here
            admitted = self._admitted[kv_label] = self._requests.labels(kv_label)
        admitted.inc()
        return DecodeAccepted(request_id=request_id, status=DecodeStatus.ACCEPTED)

    async def _admit_on_device(self, request: DecodeRequest, params: SamplingParams) -> Admission | None:
        """Admit with the KV copied device to device from a same-host owner (CUDA IPC); None: use the data plane."""
        handle = request.kv_handle
        assert handle is not None and handle.device_transfer is not None
        kv = PeerDeviceKv(handle.device_transfer, handle.block_ids)
        try:
            admission = await self.runtime.run(AddRequest(_engine_request(request, params, kv)))
        except RuntimeError as exc:  # mapping refused (DeviceTransferError), GPU not visible
            log.warning("device pull from %s failed (%s): using the data plane", handle.owner_worker_id, exc)
            return None
        # Off the engine thread: it steps on meanwhile. A CUDA error here is sticky (the engine fails with it).
        await asyncio.to_thread(admission.wait_copied)
        self._release(handle)  # the copy has completed (or, no block free, never started): the owner may reuse them
        return admission

    async def _pull(self, handle: KvHandle) -> list[BytesLike] | None:
        """The handle's blocks (through the owner's transfer engine first when `_handoff_path` says so), or None
        (lease gone, peer down, checksum): the caller recomputes."""
        try:
            client = self._client(handle.data_plane_address)
            payloads = await self._pull_through_transfer_engine(client, handle)
            if payloads is None:
                payloads = await asyncio.wait_for(client.get_blocks(handle.request_id, handle.block_ids,
                                                                    layout_id=handle.layout_id),
                                                  self.settings.kv_pull_timeout_s)
                self._pulls.labels("data_plane").inc()
            return payloads
        except (DataPlaneError, OSError, TimeoutError) as exc:
            log.warning("pull from %s failed (%s): recomputing the prompt", handle.owner_worker_id, exc)
            return None
        finally:
            self._release(handle)

    def _handoff_path(self, handle: KvHandle) -> str:
        """"transfer_engine" or "dataplane" (kv_transport, the handle's owner and host, the library here)."""
        return handoff_path(self._transport, handle, self._host_id, not self._transfer_engine_error)

    async def _pull_through_transfer_engine(self, client: DataPlaneClient, handle: KvHandle) -> list[BytesLike] | None:
        """The blocks leased and read through the owner's transfer engine, checksums verified, the lease released;
        None when this pull does not take it or it failed (then the data-plane get of the same blocks). An ended
        lease or a lost connection raise: the data plane could not serve them either."""
        if self._handoff_path(handle) != "transfer_engine":
            return None
        reads = self._handoff_reads
        try:
            blocks = await asyncio.wait_for(reads.get_held(client, handle.request_id, handle.block_ids,
                                                           handle.layout_id), self.settings.kv_pull_timeout_s)
        except (LeaseExpired, DataPlaneConnectionError):
            raise
        except TransferEngineUnavailable as exc:
            self._transfer_engine_error = str(exc)
            log.warning("P/D handoffs take the data plane: %s", exc)
            return None
        except Exception as exc:  # refused, no export room, torn, a transfer error, a checksum: the data plane
            reads.num_fallbacks += 1
            self._pulls.labels("transfer_engine_fallback").inc()
            level = logging.WARNING if reads.num_fallbacks == 1 else logging.DEBUG  # the first says why, once
            log.log(level, "pull from %s through its transfer engine failed (%r): the data-plane get serves it "
                    "(fallbacks after the first are logged at debug)", handle.owner_worker_id, exc)
            return None
        self._pulls.labels("transfer_engine").inc()
        return blocks

    def _release(self, handle: KvHandle) -> None:
        release = Release(request_id=handle.request_id)
        self._tasks.spawn(self.bus.publish(subjects.release(self.runtime.model, handle.owner_worker_id), release))

    def _client(self, address: str) -> DataPlaneClient:
        client = self._clients.get(address)
        if client is None:
            secret = self.settings.common.data_plane_secret
            client = DataPlaneClient(address, secret.get_secret_value() if secret else "",
                                     timeout_s=self.settings.kv_pull_timeout_s)
            self._clients[address] = client
        return client

    # -- engine outputs → token batches ------------------------------------------------------------------------
    def _on_outputs(self, outputs: list[EngineOutput]) -> None:
        """One TokenBatch per gateway per step, carrying only the new tokens of its requests. Runs on the event
        loop once per step, beside the engine thread (held GIL it waits for): a chunk is joined from bytes packed
        when its stream opened (`TokenBatchWriter`), and the step's batches go to the socket at once
        (`Bus.publish_now`: no coroutine, no task, no extra turn of the loop)."""
        self._step += 1
        started_s = time.monotonic()
        streams, writer, steady_middle = self._streams, self._writer, STEADY_MIDDLE
        one_token, counts, token_ids = writer.one_token, writer.counts, writer.token_ids
        for pieces in self._batches.values():  # every gateway's batch starts empty (a failed step's too)
            del pieces[1:]
        traced: list[tuple[str, Context, int]] | None = None
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is None:
                continue
            new_token_ids = output.new_token_ids
            if stream.steady and output.finish_reason is None:  # `TokenBatchWriter.add_steady`, inlined
                num_tokens = stream.num_tokens
                stream.pieces += (
                    stream.prefix,
                    (len(new_token_ids) == 1 and one_token.get(new_token_ids[0])) or token_ids(new_token_ids),
                    steady_middle,
                    counts[num_tokens] if num_tokens < PACKED_COUNTS else writer.pack(num_tokens),
                )
            else:
                self._add_chunk(stream.pieces, stream, output)
            stream.num_tokens += len(new_token_ids)
            if stream.token_spans is not None and stream.token_spans.wanted(output.finish_reason is not None):
                traced = traced if traced is not None else []
                traced.append((stream.gateway_id, stream.token_spans.context, len(new_token_ids)))
            if output.finish_reason is not None:
                del streams[output.request_id]
        batches = {gateway_id: pieces for gateway_id, pieces in self._batches.items() if len(pieces) > 1}
        if batches or self._solo:
            self._publish(batches, started_s, traced)

    def _batch_pieces(self, gateway_id: str) -> list[bytes]:
        """The list a gateway's chunks of the step in progress go to (`TokenBatchWriter.open`), made once."""
        pieces = self._batches.get(gateway_id)
        if pieces is None:
            if len(self._batches) >= MAX_CACHED_SUBJECTS:  # gateways restart under new ids: keep those in use
                self._batches = {stream.gateway_id: stream.pieces for stream in self._streams.values()}
            pieces = self._batches[gateway_id] = self._writer.open()
        return pieces

    def _publish(self, batches: dict[str, list[bytes]], started_s: float,
                 traced: list[tuple[str, Context, int]] | None) -> None:
        """Send this step's batches; with tracing on each is a `token_batch` hop observation (outputs received →
        published), and the traced requests' batches that their `TokenSpans` picked are `decode.token_batch` spans."""
        step, writer = self._step, self._writer
        solo, self._solo = self._solo, []  # before the step's batches: a request's first chunk stays its first
        messages = [(self._token_subject(gateway_id), writer.close(pieces, step))
                    for gateway_id, pieces in [*solo, *batches.items()]]
        self.runtime.outbox.publish(messages, "token-batch")  # with the step's KV event batch when it has one
        hops = self.runtime.hops
        if hops.recording:
            published_s = time.monotonic()
            hops.observe("token_batch", published_s - started_s, len(messages))
            for gateway_id, context, num_tokens in traced or ():
                hops.record_span("token_batch", started_s, published_s, context, step=step, num_tokens=num_tokens,
                                 num_chunks=num_chunks(batches[gateway_id]) if gateway_id in batches else 1)

    def _add_chunk(self, pieces: list[bytes], stream: _Stream, output: EngineOutput) -> None:
        """A chunk other than a steady one: the first (cached tokens, the prompt's logprobs), with logprobs, or the
        last. A chunk with prompt logprobs is a TokenBatch of its own (`_solo`): a long prompt's scores must not
        push its gateway's whole step over the bus's message size (the gateway sized them against it)."""
        first = not stream.sent_first
        stream.sent_first = True
        stream.steady = not stream.want_logprobs
        prompt_logprobs = wire_prompt_logprobs(output) if first else None
        if prompt_logprobs is not None:
            pieces = self._writer.open()
            self._solo.append((stream.gateway_id, pieces))
        self._writer.add(
            pieces, stream.prefix, output.new_token_ids,
            logprobs=_logprobs(output) if stream.want_logprobs else None,
            finish_reason=output.finish_reason,
            num_cached_tokens=output.num_cached_tokens if first else None,
            cached_tokens_by_tier=cached_tokens_by_tier(output) if first else None,
            prompt_logprobs=prompt_logprobs,
            num_previous_tokens=stream.num_tokens,
        )

    def _token_subject(self, gateway_id: str) -> str:
        subject = self._token_subjects.get(gateway_id)
        if subject is None:
            if len(self._token_subjects) >= MAX_CACHED_SUBJECTS:  # gateways restart under new ids
                self._token_subjects.clear()
            subject = self._token_subjects[gateway_id] = subjects.tokens(self.runtime.model, gateway_id)
        return subject

    def _on_cancel(self, cancel: Cancel) -> None:
        if self._streams.pop(cancel.request_id, None) is None or self.runtime.engine_loop is None:
            return
        self._tasks.spawn(self.runtime.run(Abort([cancel.request_id])))


def _engine_request(request: DecodeRequest, params: SamplingParams, kv: KvSource) -> EngineRequest:
    return EngineRequest(request.request_id, request.prompt_token_ids, params, request.cache_salt,
                         request.output_token_ids, kv=kv)


def _refused(request_id: str, error: ErrorDetail) -> DecodeAccepted:
    return DecodeAccepted(request_id=request_id, status=DecodeStatus.REFUSED, error=error)


def _logprobs(output: EngineOutput) -> list[TokenLogprobs] | None:
    if not output.new_logprobs:
        return None
    return [TokenLogprobs(token_id=s.token_id, logprob=s.logprob, top=list(s.top_logprobs or []))
            for s in output.new_logprobs]
