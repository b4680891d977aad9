"""`WorkerRuntime`: what a prefill or decode worker runs besides its request handling.

    engine thread (EngineLoop) ──outputs──► role handler (prefill: first tokens; decode: token batches)
    heartbeat task  ── WorkerLoad every heartbeat_interval_s ──► heartbeat(model, worker_id)
    KV events       ── KvEventBatch (seq +1 per batch, epoch; device and host tier) ───► kv_events(model, worker_id)
                    ── blocks newly cached ──► StoreTier write-behind (kvcache store; admission loads from it)
    snapshot        ◄─ SnapshotRequest ─ a scheduler; SnapshotPage (cut on the engine thread, at a seq) ─►
    cancel(model)   ── Cancel ──► role handler's on_cancel
    tasks           ── BackgroundTasks shared with the role handler: publishes, engine commands; flushed on drain
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry

from deepinfer import subjects
from deepinfer.bus import IncomingMsg, MessageBus, Subscriptions
from deepinfer.config import WorkerSettings
from deepinfer.engine import (
    AddRequest,
    Admission,
    ComputeKv,
    Engine,
    EngineCommand,
    EngineOutput,
    EngineRequest,
    EngineStats,
    KvCacheEvent,
    StartProgress,
)
from deepinfer.protocol import (
    Cancel,
    ErrorDetail,
    KvLayout,
    Message,
    SnapshotRequest,
    WorkerLoad,
    WorkerRole,
)
from deepinfer.tasks import BackgroundTasks
from deepinfer.telemetry import gauge, request_context
from deepinfer.telemetry.hops import Hops
from deepinfer.worker.engine_loop import EngineLoop, StepTimes
from deepinfer.worker.errors import error_detail
from deepinfer.worker.host_tier_metrics import HostTierMetrics
from deepinfer.worker.kv_cost_metrics import KvCostMetrics
from deepinfer.worker.kv_event_wire import encode_kv_event_batch
from deepinfer.worker.kv_snapshot import SnapshotPages
from deepinfer.worker.model_server_metrics import ModelServerGauges
from deepinfer.worker.outbox import Outbox
from deepinfer.worker.settings import engine_args
from deepinfer.worker.spec_decode_metrics import SpecDecodeMetrics
from deepinfer.worker.store_tier import StoreTier, start_store_client

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest close() waits for background work left after (or without) a drain.
CLOSE_FLUSH_S = 2.0
#: Least time between two heartbeats sent because the load changed (the periodic one goes on besides): the
#: scheduler's in-flight counts end at a heartbeat, so a routed request stops counting twice, and a finished one
#: stops counting as load, within this.
LOAD_CHANGE_HEARTBEAT_S = 0.05
#: While the engine loads, one log line this often says which phase it is in (a start shorter than this: none).
START_REPORT_INTERVAL_S = 5.0
#: Young-generation collection threshold once the engine is loaded (Python's default: 700 allocations; the
#: gateway's too, services/gateway/main.py).
GC_THRESHOLD_0 = 10_000


async def report_slow_start(progress: StartProgress, interval_s: float) -> None:
    """Every `interval_s` until cancelled, one log line: how long the engine has been starting, the phase it is in
    and the phases done, e.g. "engine starting for 10 s: preparing the model 0.1 s, loading weights 9.9 s (now)"."""
    while True:
        await asyncio.sleep(interval_s)
        log.info("engine starting for %.0f s: %s", progress.elapsed_s(), progress.describe())


class WorkerRuntime:
    """Loads the engine, runs it on its thread, and keeps the worker visible (heartbeats, KV events)."""

    def __init__(
        self,
        settings: WorkerSettings,
        role: WorkerRole,
        bus: MessageBus,
        registry: CollectorRegistry,
        tracer: Tracer | None = None,
    ):
        self.settings = settings
        self.role = role
        self.bus = bus
        self.model = settings.common.model_token
        self.worker_id = settings.worker_id
        #: The engine's front door (properties, hints); work for it goes through `run` (None until loaded).
        self.engine: Engine | None = None
        #: The thread that steps the engine and applies its commands.
        self.engine_loop: EngineLoop | None = None
        self.layout: KvLayout | None = None
        #: The kvcache store tier (None with kv_store off): admission loads, write-behind.
        self.store: StoreTier | None = None
        #: Metrics of the engine's host-memory KV tier (None when the tier is off).
        self.host_tier_metrics: HostTierMetrics | None = None
        #: vLLM's spec_decode counters, on a worker that speculates (None: it does not).
        self.spec_decode_metrics: SpecDecodeMetrics | None = None
        #: Measured load and prefill rates, and the load-or-recompute decisions (None until loaded).
        self.kv_cost_metrics: KvCostMetrics | None = None
        self.data_plane_address = ""
        self.internal_address = ""
        self.draining = False
        self.on_outputs: Callable[[list[EngineOutput]], None] = lambda outputs: None
        self.on_cancel: Callable[[Cancel], None] = lambda cancel: None
        #: Boot id: seq starts again in every epoch, so a scheduler tells a restart from lost events.
        self.epoch = uuid.uuid4().hex[:16]
        self.snapshots = SnapshotPages(self.worker_id, self.epoch, self._cut_snapshot)
        self._heartbeat_task: asyncio.Task[None] | None = None
        #: Background work of this worker (its role handler's too): held, failures logged, flushed on stop.
        self.tasks = BackgroundTasks(f"{role.value} {settings.worker_id}")
        #: Per-step batches and replies on their way to the socket, in as few writes as possible.
        self.outbox = Outbox(bus, self.tasks)
        #: Spans and `deepinfer_<role>_hop_seconds` of the hops a request takes here.
        self.hops = Hops(tracer, registry, role.value)
        self._subscriptions = Subscriptions(bus)
        self._registry = registry
        self._heartbeats_sent = 0
        self._published_load = (0, 0, 0)
        self._last_heartbeat_s = 0.0
        self._load_heartbeat_pending = False
        self._kv_events_subject = subjects.kv_events(self.model, self.worker_id)
        #: The engine's load last compared with the published load.
        self._checked_load: EngineStats | None = None
        self.stats = EngineStats(0, 0, 0, 0, 0)
        self._gauges = {
            name: gauge(registry, f"worker_{name}", doc)
            for name, doc in (
                ("running_requests", "Requests in the running batch."),
                ("waiting_requests", "Requests waiting for admission."),
                ("held_leases", "Finished prefills whose KV blocks are held for a decode worker."),
                ("free_blocks", "KV blocks not referenced by any request."),
                ("total_blocks", "KV blocks in the pool (the padding block excluded)."),
            )
        }
        #: The same load under the names the Kubernetes inference gateway's model-server protocol scrapes
        #: (TotalQueuedRequests, TotalRunningRequests, KVCacheUtilization as vLLM names them; both KV names).
        self._model_server_gauges = ModelServerGauges(registry)

    async def load(self) -> None:
        """Load the model on a thread (the event loop keeps answering NATS meanwhile) and start the engine."""
        started = time.perf_counter()
        # The store's shards heartbeat every second or so: follow them while the model loads.
        client = await start_store_client(self.settings, self.bus) if self.settings.kv_store else None
        progress = StartProgress()
        reporter = asyncio.create_task(report_slow_start(progress, START_REPORT_INTERVAL_S), name="start-progress")
        try:
            self.engine = engine = await asyncio.to_thread(Engine, engine_args(self.settings), progress)
        except BaseException:
            if client is not None:
                await client.close()
            raise
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        gc.freeze()  # the model and start-up objects never die: keep them out of every later collection
        # Young collections every GC_THRESHOLD_0 allocations, not 700: a wave of 64 admissions (a task, futures and
        # coroutines each, alive for milliseconds) set off one on the event loop every ~10 admissions, ~100 µs
        # each, and the engine thread's per-step objects one every few steps, in series with the device.
        gc.set_threshold(GC_THRESHOLD_0, *gc.get_threshold()[1:])
        self.layout = engine.kv_layout
        if engine.has_host_tier:
            report = engine.host_tier_report()
            self.host_tier_metrics = HostTierMetrics(self._registry, report.capacity_bytes)
            self.host_tier_metrics.update(report)
        if engine.args.speculative_config is not None:
            self.spec_decode_metrics = SpecDecodeMetrics(self._registry)
        if engine.args.enable_hybrid_kv_cache:
            gauge(self._registry, "worker_kv_replayed_tokens",
                  "KV by layer type: tokens prefix hits recomputed although the global layers had them cached (a "
                  "hit needs the local layers' window before it; a counter).").set_function(
                      lambda: engine.num_replayed_tokens)
        self.kv_cost_metrics = KvCostMetrics(self._registry, engine.rates)
        gauge(self._registry, "worker_kernel_compiles_serving",
              "Triton compiles since the engine started (a step waited for each; the log names the kernel)."
              ).set_function(lambda: engine.num_serving_compiles)
        self.engine_loop = engine_loop = EngineLoop(engine, asyncio.get_running_loop(), self._on_step)
        gauge(self._registry, "worker_engine_steps", "Engine steps since the engine started (a counter)."
              ).set_function(lambda: engine_loop.num_steps)
        gauge(self._registry, "worker_cuda_graph_replays",
              "Steps that replayed a captured CUDA graph (decode-only batches); the rest ran eagerly (a counter)."
              ).set_function(lambda: engine.num_graph_replays)
        engine_loop.after_command = self._heartbeat_on_load_change
        engine_loop.on_step_time = StepTimes(self._registry).observe
        engine_loop.start()
        # A tensor-parallel engine stays out of the store: rank 0's cache holds only its share of the KV heads; so
        # does one with KV by layer type: its blocks are pages of one group's layers, not a block of every layer.
        if client is not None and engine.args.tensor_parallel_size == 1 and not engine.args.enable_hybrid_kv_cache:
            self.store = StoreTier(self.settings, self._registry, engine, engine_loop, client)
        elif client is not None:
            await client.close()
        log.info(
            "engine loaded in %.1f s: %s, %d KV blocks, layout %s, execution mode %s (%s)",
            time.perf_counter() - started, engine.model_dir.name, engine.num_kv_blocks, self.layout.layout_id(),
            engine.execution_mode, progress.describe(),
        )

    async def start(self, internal_address: str, data_plane_address: str) -> None:
        """Subscribe to cancels and start heartbeats; the worker becomes visible to the scheduler."""
        self.internal_address, self.data_plane_address = internal_address, data_plane_address
        await self._subscriptions.subscribe(
            "cancel", subjects.cancel(self.model), self._on_cancel, message_type=Cancel
        )
        if self.store is not None:
            await self.store.start()
        await self._subscriptions.subscribe(
            "snapshot", subjects.snapshot(self.model, self.worker_id), self._on_snapshot,
            message_type=SnapshotRequest,
        )
        await self.heartbeat()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")

    async def run(self, command: EngineCommand[T]) -> T:
        """Apply a command on the engine thread between steps; its result (RuntimeError: not loaded or stopped)."""
        if self.engine_loop is None:
            raise RuntimeError("engine not loaded")
        return await self.engine_loop.call(command)

    async def add_request(self, request: EngineRequest) -> Admission:
        """Admit a request into the engine; one to compute has its prefix loaded from the kvcache store where the
        store holds it (StoreTier). ValueError for an invalid request."""
        if self.store is not None and isinstance(request.kv, ComputeKv):
            return await self.store.add_request(request)
        return await self.run(AddRequest(request))

    def is_ready(self) -> bool:
        """Model loaded, engine thread alive, registered with at least one heartbeat, not draining."""
        loop = self.engine_loop
        return loop is not None and loop.alive and self._heartbeats_sent > 0 and not self.draining

    def not_ready_reason(self) -> str:
        """Why is_ready() is False."""
        if self.engine_loop is None:
            return "loading model"
        if not self.engine_loop.alive:
            return f"engine failed: {self.engine_loop.error}"
        return "draining" if self.draining else "registering"

    def unhealthy_reason(self) -> str:
        """Why the worker cannot recover by itself ("" when healthy): its engine thread failed, or one step has
        run past `engine_step_deadline_s` (a hung device or collective). /health answers 503 with it, so the
        supervisor or the kubelet restarts the process. Loading is not unhealthy."""
        engine = self.engine_loop
        if engine is None:
            return ""
        if not engine.alive and not engine.stopping:
            return f"engine failed: {engine.error}"
        started_s = engine.step_started_s
        if started_s is not None and time.monotonic() - started_s > self.settings.engine_step_deadline_s:
            return (f"engine step running for {time.monotonic() - started_s:.0f} s "
                    f"(engine_step_deadline_s={self.settings.engine_step_deadline_s:g})")
        return ""

    async def heartbeat(self) -> None:
        """Publish one WorkerLoad with fresh engine numbers."""
        assert self.engine is not None and self.engine_loop is not None and self.layout is not None
        self.stats = self.engine_loop.stats  # the engine thread's last snapshot: never wait for a running step
        for name, value in (
            ("running_requests", self.stats.num_running), ("waiting_requests", self.stats.num_waiting),
            ("held_leases", self.stats.num_held), ("free_blocks", self.stats.num_free_blocks),
            ("total_blocks", self.stats.num_total_blocks),
        ):
            self._gauges[name].set(value)
        self._model_server_gauges.set(self.stats)
        if self.host_tier_metrics is not None:
            self.host_tier_metrics.update(self.engine.host_tier_report())
        if self.spec_decode_metrics is not None:
            self.spec_decode_metrics.update(self.engine.spec_decode_stats())
        if self.kv_cost_metrics is not None:
            self.kv_cost_metrics.update()
        load = self._worker_load()
        self._published_load = (load.num_running, load.num_waiting, load.num_received or 0)
        self._last_heartbeat_s = time.monotonic()
        await self.bus.publish(subjects.heartbeat(self.model, self.worker_id), load)
        self._heartbeats_sent += 1

    async def drain(self) -> None:
        """Announce draining (the scheduler stops picking this worker)."""
        self.draining = True
        with contextlib.suppress(Exception):
            await self.heartbeat()

    def reply_in_background(
        self,
        msg: IncomingMsg,
        request_id: str,
        hop: str,
        answer: Callable[[], Awaitable[Message]],
        on_failure: Callable[[ErrorDetail], Message],
    ) -> None:
        """Answer one request on its own task (a subscription's handlers run one at a time, and a prefill or a
        KV pull must not hold up the next): reply `answer()`, or `on_failure(error)` if it raised, so the
        gateway is never left waiting. The whole is the hop `hop` (a span in the sender's trace)."""

        async def run() -> None:
            with request_context(request_id), self.hops.span(hop, request_id=request_id):
                try:
                    reply = await answer()
                except Exception as exc:
                    log.exception("%s %s failed", self.role.value, hop)
                    reply = on_failure(error_detail(exc, f"{self.role.value} {hop} failed"))
                if not self.outbox.reply_soon(msg, reply):  # queued: written with the others of this turn
                    await self.bus.reply(msg, reply)

        self.tasks.spawn(run(), name=f"{hop}-{request_id}")

    async def flush(self, timeout_s: float) -> None:
        """Wait for background work (the last token batch, Release, KV-event publish) up to `timeout_s`."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        await self.tasks.drain(max(0.0, timeout_s))
        if self.store is not None:  # blocks of the last steps reach the store before the worker stops
            await self.store.flush(deadline - time.monotonic())

    async def close(self) -> None:
        """Stop heartbeats, unsubscribe, flush what is left in the background, stop the engine thread."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
            self._heartbeat_task = None
        await self._subscriptions.close()
        await self.flush(CLOSE_FLUSH_S)
        if self.store is not None:
            await self.store.close()
        if self.engine_loop is not None:
            await self.engine_loop.stop()

    def _worker_load(self) -> WorkerLoad:
        engine, layout, stats = self.engine, self.layout, self.stats
        assert engine is not None and layout is not None
        costs = engine.kv_costs(self.store.store_path() if self.store is not None else None)
        return WorkerLoad(
            worker_id=self.worker_id,
            role=self.role,
            model=self.model,
            model_fingerprint=engine.fingerprint,
            layout_id=layout.layout_id(),
            block_size=engine.block_size,
            max_num_seqs=engine.args.max_num_seqs,
            max_model_len=engine.max_model_len,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            num_received=stats.num_added,
            data_plane_address=self.data_plane_address,
            internal_address=self.internal_address,
            draining=self.draining,
            epoch=self.epoch,
            kv_bytes_per_block=costs.kv_bytes_per_block,
            prefill_tokens_per_s=costs.prefill_tokens_per_s,
            host_load_bytes_per_s=costs.host_bytes_per_s,
            store_load_bytes_per_s=costs.store_bytes_per_s,
            ts=time.time(),
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                await self.heartbeat()
            except Exception:  # a lost heartbeat must not kill the loop: the next one may get through
                log.warning("heartbeat failed", exc_info=True)

    def _on_step(self, outputs: list[EngineOutput], events: list[KvCacheEvent], seq: int) -> None:
        if not events:
            if outputs:
                self.on_outputs(outputs)
            self._heartbeat_on_load_change()
            return
        # The step's token batches (the role handler's `outbox.publish`) and its KV event batch go to the socket in
        # one write (one sendmsg, one GIL handoff); the KV batch even if the handler failed (no seq gap).
        self.outbox.hold()
        try:
            if outputs:
                self.on_outputs(outputs)
        finally:
            messages = self.outbox.release()
            messages.append((self._kv_events_subject,
                             encode_kv_event_batch(self.worker_id, seq, events, time.time(), self.epoch)))
            self.outbox.publish(messages, "kv-events")
            if self.store is not None:
                self.store.on_kv_events(events)
        self._heartbeat_on_load_change()

    def _heartbeat_on_load_change(self) -> None:
        """One heartbeat soon (at most every LOAD_CHANGE_HEARTBEAT_S) when running, waiting or admitted moved;
        checked after every step and every engine command (an abort leaves no step to follow it). The engine
        replaces its load only when a number changes: a step that changed nothing costs one identity check."""
        if self.engine_loop is None or self._load_heartbeat_pending or self._heartbeat_task is None:  # not started
            return
        load = self.engine_loop.stats
        if load is self._checked_load:
            return
        self._checked_load = load
        if (load.num_running, load.num_waiting, load.num_added) == self._published_load:
            return
        self._load_heartbeat_pending = True
        delay_s = max(0.0, self._last_heartbeat_s + LOAD_CHANGE_HEARTBEAT_S - time.monotonic())
        self.tasks.spawn(self._load_change_heartbeat(delay_s), name="load-heartbeat")

    async def _load_change_heartbeat(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self._load_heartbeat_pending = False
        await self.heartbeat()

    async def _cut_snapshot(self) -> tuple[int, list[bytes], list[bytes]]:
        assert self.engine_loop is not None
        return await self.engine_loop.cut_kv_snapshot()

    async def _on_snapshot(self, request: SnapshotRequest, msg: IncomingMsg) -> None:
        if self.engine_loop is None:
            return  # not loaded: no reply, the scheduler retries after its timeout
        await self.bus.reply(msg, await self.snapshots.page(request))

    async def _on_cancel(self, cancel: Cancel, msg: IncomingMsg) -> None:
        self.on_cancel(cancel)
