"""The prefill worker. Per PrefillRequest on `prefill(model, worker_id)`:

    receive → prefill (engine computes the prompt, samples the first token, holds the KV blocks)
    → reply PrefillResult{first token, KvHandle, the prompt's logprobs when asked} → serve the blocks on the data
    plane (a get; with `transfer_engine`, also a lease of export slots a decode worker's transfer engine reads)
    → Release or lease expiry

A request whose first token already ends it (eos, a stop token, max_tokens 1) releases its blocks at once and
its result carries the finish reason and no handle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from deepinfer import subjects
from deepinfer.bus import IncomingMsg, Subscriptions
from deepinfer.config import PrefillSettings
from deepinfer.dataplane import DataPlaneError, DataPlaneServer, LeaseExpired
from deepinfer.dataplane.frames import LeaseVia
from deepinfer.dataplane.transfer_engine import TransferEngine
from deepinfer.engine import (
    Abort,
    EngineOutput,
    EngineRequest,
    ExportDeviceKv,
    ExportHeld,
    HeldBlockIds,
    LeaseNotHeld,
    ReleaseHeld,
)
from deepinfer.hashing import hash_blocks
from deepinfer.host_identity import host_id as this_host_id
from deepinfer.kvcache.shm import SlotLease
from deepinfer.protocol import (
    Cancel,
    ErrorCode,
    ErrorDetail,
    FinishReason,
    KvHandle,
    PrefillRequest,
    PrefillResult,
    Release,
    TokenLogprobs,
    WorkerRole,
)
from deepinfer.protocol.kv import KvDeviceExport
from deepinfer.service import ServiceContext
from deepinfer.telemetry import counter
from deepinfer.worker.errors import error_detail
from deepinfer.worker.handoff_exports import HandoffExports
from deepinfer.worker.prompt_logprobs import wire_prompt_logprobs
from deepinfer.worker.runtime import WorkerRuntime
from deepinfer.worker.settings import engine_sampling
from deepinfer.worker.store_tier import cached_tokens_by_tier

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A prefill in the engine, waiting for its first token."""

    done: asyncio.Future[EngineOutput]
    tokens: list[int] = field(default_factory=list)


class PrefillHandler:
    """Prompt compute + KV leases for one model; a `deepinfer.service.Handler`."""

    def __init__(self, ctx: ServiceContext[PrefillSettings]) -> None:
        self.ctx = ctx
        self.settings = settings = ctx.settings
        self.bus = ctx.bus
        registry = ctx.registry
        self.runtime = WorkerRuntime(settings, WorkerRole.PREFILL, ctx.bus, registry, ctx.tracer)
        self.runtime.on_outputs = self._on_outputs
        self.runtime.on_cancel = self._on_cancel
        self.data_plane: DataPlaneServer | None = None
        #: The KV cache exported once for same-host CUDA IPC pulls; None on the CPU (data plane only).
        self._device_export: KvDeviceExport | None = None
        #: Export slots leased to decode workers' transfer engines (`transfer_engine`); None: the data-plane get only.
        self._exports: HandoffExports | None = None
        self._host_id = this_host_id()
        self._pending: dict[str, _Pending] = {}
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._tasks = self.runtime.tasks
        self._subscriptions = Subscriptions(ctx.bus)
        self._requests = counter(registry, "prefill_requests", "Prefill requests by outcome.", ["outcome"])

    # -- lifecycle ----------------------------------------------------------------------------------------------
    async def load(self) -> None:
        """Load the model and bind the data plane (before the internal server reports ready)."""
        await self.runtime.load()
        self._device_export = await self.runtime.run(ExportDeviceKv())
        if self.settings.transfer_engine:
            self._exports = await asyncio.to_thread(self._start_exports)
        secret = self.settings.common.data_plane_secret
        self.data_plane = DataPlaneServer(
            self, host=self.settings.data_plane_host, port=self.settings.data_plane_port,
            secret=secret.get_secret_value() if secret else None,
        )
        await self.data_plane.start()

    def _start_exports(self) -> HandoffExports:
        """This process's transfer engine (named data_plane_host, as its store client's) and the export slots
        registered with it, once. Raises when the library does not load: the setting asked for it."""
        engine = self.runtime.engine
        assert engine is not None
        exports = HandoffExports(TransferEngine.shared(self.settings.data_plane_host, "tcp"),
                                 self.settings.transfer_engine_export_bytes, engine.kv_bytes_per_block)
        log.info("handoff exports: %d slots of %d bytes registered with the transfer engine %s", exports.num_slots,
                 exports.remote_region.slot_bytes, exports.remote_region.session_id)
        return exports

    async def start(self) -> None:
        """Take prefill requests and releases; start heartbeats."""
        assert self.data_plane is not None
        model, worker_id = self.runtime.model, self.runtime.worker_id
        subscriptions = self._subscriptions
        await subscriptions.subscribe("prefill", subjects.prefill(model, worker_id), self._on_prefill,
                                      message_type=PrefillRequest)
        await subscriptions.subscribe("release", subjects.release(model, worker_id), self._on_release,
                                      message_type=Release)
        await self.runtime.start(self.ctx.internal_address, self.data_plane.address)

    def is_ready(self) -> bool:
        """Model loaded, data plane bound, registered."""
        return self.data_plane is not None and self.runtime.is_ready()

    def not_ready_reason(self) -> str:
        """Why not ready."""
        return "binding data plane" if self.data_plane is None else self.runtime.not_ready_reason()

    def unhealthy_reason(self) -> str:
        """Why /health fails ("" when healthy): the engine failed or a step is stuck."""
        return self.runtime.unhealthy_reason()

    async def drain(self, grace_s: float) -> None:
        """Stop taking prefills; finish running ones and let decode workers pull leased KV (their Releases
        still arrive), then flush background work, within grace_s."""
        await self.runtime.drain()
        await self._subscriptions.unsubscribe("prefill")
        deadline = time.monotonic() + grace_s
        while (self._pending or self._leases) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.runtime.flush(deadline - time.monotonic())

    async def close(self) -> None:
        """Release leases, stop the data plane and the engine."""
        for handle in self._leases.values():
            handle.cancel()
        self._leases.clear()
        await self._subscriptions.close()
        if self.data_plane is not None:
            await self.data_plane.close(drain_timeout_s=1.0)
        if self._exports is not None:
            self._exports.close()
        await self.runtime.close()

    # -- the loop -----------------------------------------------------------------------------------------------
    async def _on_prefill(self, request: PrefillRequest, msg: IncomingMsg) -> None:
        """receive → prefill → reply (→ lease), on its own task."""
        request_id = request.request_id

        async def answer() -> PrefillResult:
            result = await self.prefill(request)
            self._requests.labels("error" if result.error else "ok").inc()
            return result

        def on_failure(error: ErrorDetail) -> PrefillResult:
            self._requests.labels("error").inc()
            return PrefillResult(request_id=request_id, error=error, finish_reason=FinishReason.ERROR)

        self.runtime.reply_in_background(msg, request_id, "request", answer, on_failure)

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Run the prompt through the engine; the first token, and a handle to the held KV unless finished."""
        request_id = request.request_id
        try:
            params = engine_sampling(request.sampling)
        except ValueError as exc:
            return PrefillResult(request_id=request_id, error=error_detail(exc, "invalid sampling"))
        first_params = params.clone(max_tokens=1, min_tokens=min(params.min_tokens, 1))
        pending = _Pending(asyncio.get_running_loop().create_future())
        self._pending[request_id] = pending
        added_s = time.monotonic()  # the engine thread takes the command between steps: waiting starts here
        try:
            await self.runtime.add_request(EngineRequest(request_id, request.prompt_token_ids, first_params,
                                                         request.cache_salt, hold_blocks=True))
        except ValueError as exc:
            self._pending.pop(request_id, None)
            return PrefillResult(request_id=request_id, error=error_detail(exc, "invalid request"))
        output = await pending.done
        if output.first_scheduled_time is not None:  # an abort before its first step has none
            hops, scheduled_s = self.runtime.hops, output.first_scheduled_time
            hops.record("queue", added_s, scheduled_s)
            hops.record("compute", scheduled_s, time.monotonic(), num_prompt_tokens=len(request.prompt_token_ids),
                        num_cached_tokens=output.num_cached_tokens)
        return await self._result(request, params, output)

    async def _result(self, request: PrefillRequest, params, output: EngineOutput) -> PrefillResult:
        request_id, engine = request.request_id, self.runtime.engine
        assert engine is not None
        if output.finish_reason == FinishReason.ABORT:
            await self.runtime.run(ReleaseHeld(request_id))
            cancelled = ErrorDetail(code=ErrorCode.CANCELLED, message="cancelled while prefilling")
            return PrefillResult(request_id=request_id, finish_reason=FinishReason.ABORT, error=cancelled)
        first = output.new_token_ids[0]
        num_prompt = len(request.prompt_token_ids)
        finish = None
        if output.finish_reason == FinishReason.STOP:
            finish = FinishReason.STOP
        elif params.max_tokens == 1 or num_prompt + 1 >= engine.max_model_len:
            finish = FinishReason.LENGTH
        result = PrefillResult(
            request_id=request_id,
            first_token_id=first,
            first_logprobs=_logprobs(output) if params.logprobs is not None else None,
            num_cached_tokens=output.num_cached_tokens,
            cached_tokens_by_tier=cached_tokens_by_tier(output),
            finish_reason=finish,
            prompt_logprobs=wire_prompt_logprobs(output),
        )
        if finish is not None:
            await self.runtime.run(ReleaseHeld(request_id))
            return result
        block_ids = await self.runtime.run(HeldBlockIds(request_id))
        result.kv_handle = KvHandle(
            request_id=request_id,
            block_hashes=hash_blocks(request.prompt_token_ids, engine.block_size, engine.fingerprint,
                                     request.cache_salt),
            block_ids=block_ids,
            num_tokens=num_prompt,
            owner_worker_id=self.runtime.worker_id,
            data_plane_address=self.runtime.data_plane_address,
            layout=self.runtime.layout,
            layout_id=self.runtime.layout.layout_id(),
            lease_expires_at_unix_s=time.time() + self.settings.kv_lease_s,
            device_transfer=self._device_export,
            transfer_engine=self._exports is not None,
            host_id=self._host_id,
        )
        self._leases[request_id] = asyncio.get_running_loop().call_later(
            self.settings.kv_lease_s, self._expire, request_id)
        return result

    # -- engine outputs, releases, cancels ----------------------------------------------------------------------
    def _on_outputs(self, outputs: list[EngineOutput]) -> None:
        for output in outputs:
            pending = self._pending.get(output.request_id)
            if pending is not None and output.finish_reason is not None:
                del self._pending[output.request_id]
                pending.done.set_result(output)

    async def _on_release(self, release: Release, msg: IncomingMsg) -> None:
        await self._end_lease(release.request_id, "released")

    def _on_cancel(self, cancel: Cancel) -> None:
        pending = self._pending.pop(cancel.request_id, None)
        if pending is not None and self.runtime.engine_loop is not None:
            self._tasks.spawn(self.runtime.run(Abort([cancel.request_id])))
            pending.done.set_result(EngineOutput(cancel.request_id, [], None, FinishReason.ABORT, None, 0))
        elif cancel.request_id in self._leases:
            self._tasks.spawn(self._end_lease(cancel.request_id, "cancelled"))

    def _expire(self, request_id: str) -> None:
        self._tasks.spawn(self._end_lease(request_id, "expired"))

    async def _end_lease(self, request_id: str, why: str) -> None:
        handle = self._leases.pop(request_id, None)
        if handle is None:
            return
        handle.cancel()
        if self._exports is not None:
            self._exports.end_request(request_id)  # its export slots too (a reader past this fails the seq check)
        await self.runtime.run(ReleaseHeld(request_id))
        log.debug("lease of %s %s", request_id, why)

    # -- data plane provider ------------------------------------------------------------------------------------
    async def read_blocks(self, request_id, block_ids, block_hashes, layout_id) -> list[bytes]:
        """Serve a leased request's blocks (the data plane calls this)."""
        if layout_id and self.runtime.layout is not None and layout_id != self.runtime.layout.layout_id():
            raise LeaseExpired(f"layout {layout_id} is not this worker's ({self.runtime.layout.layout_id()})")
        if request_id not in self._leases:
            raise LeaseExpired(f"no lease for request {request_id!r}")
        try:
            return await self.runtime.run(ExportHeld(request_id, block_ids))
        except LeaseNotHeld as exc:
            raise LeaseExpired(str(exc)) from exc

    async def lease_blocks(self, layout_id, block_hashes, host_id, via=LeaseVia.SHARED_MEMORY, request_id="",
                           block_ids=()) -> SlotLease:
        """Lease a held request's blocks to a transfer engine (the data plane calls this): exported as for a get,
        each copied into an export slot that stays untouched until the reader's release or the request's lease
        ends."""
        if via != LeaseVia.TRANSFER_ENGINE or self._exports is None or not block_ids:
            raise DataPlaneError("this worker leases held blocks by id to transfer engines only, and only with "
                                 "transfer_engine on")
        payloads = await self.read_blocks(request_id, block_ids, (), layout_id)
        lease = await asyncio.to_thread(self._exports.lease, request_id, block_ids, layout_id, payloads)
        if request_id not in self._leases:  # the request's lease ended while the blocks were exported
            self._exports.release(lease.lease_id)
            raise LeaseExpired(f"no lease for request {request_id!r}")
        return lease

    async def release_lease(self, lease_id) -> None:
        """A transfer engine's reader is done with its export slots."""
        if self._exports is not None:
            self._exports.release(lease_id)

    async def write_blocks(self, layout_id, block_hashes, payloads) -> None:
        """Workers take no puts."""
        raise LeaseExpired("a prefill worker does not store blocks")

    async def has_blocks(self, layout_id, block_hashes) -> list[bool]:
        """Workers answer by lease, not by hash."""
        return [False] * len(block_hashes)


def _logprobs(output: EngineOutput) -> TokenLogprobs | None:
    if not output.new_logprobs:
        return None
    sampled = output.new_logprobs[0]
    return TokenLogprobs(token_id=sampled.token_id, logprob=sampled.logprob, top=list(sampled.top_logprobs or []))
