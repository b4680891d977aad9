"""Keeps the scheduler's KvIndex fed: workers' KV event streams, the store's event streams, and snapshots.

    kv_events(model, *)      KvEventBatch ──► index.apply_batch (members only) ── gap / new epoch ──┐
    heartbeat (via handler)  WorkerLoad   ──► index.observe_worker ── new worker / epoch ───────────┤
                                                                                                     ▼
    snapshot(model, worker)  ◄── SnapshotRequest pages (one task per worker, retried while it is a member)
    di.kvcache.events.*      KvStoreEventBatch ──► index.apply_store_batch
    di.kvcache.heartbeat.*   KvStoreHeartbeat  ──► shard leases; a shard silent for the lease is removed

Runs on the event loop; the index itself is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from deepinfer import subjects
from deepinfer.bus import BusError, IncomingMsg, MessageBus, Subscriptions
from deepinfer.membership import Member, Membership
from deepinfer.protocol import (
    KvEventBatch,
    KvStoreEventBatch,
    KvStoreHeartbeat,
    ProtocolError,
    SnapshotPage,
    SnapshotRequest,
)
from deepinfer.telemetry import counter, gauge
from services.scheduler.kv_index import KvIndex

log = logging.getLogger(__name__)

#: Pause before paging a snapshot again after a failed attempt, doubling up to SNAPSHOT_RETRY_MAX_S (a worker
#: that never answers, e.g. one older than protocol 2.2, costs one request per 10 s).
SNAPSHOT_RETRY_S = 0.5
SNAPSHOT_RETRY_MAX_S = 10.0


class KvIndexFeed:
    """Subscriptions and snapshot tasks that keep `index` current; see the module docstring."""

    def __init__(
        self,
        model: str,
        bus: MessageBus,
        index: KvIndex,
        membership: Membership,
        registry: CollectorRegistry,
        snapshot_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.bus = bus
        self.index = index
        self.membership = membership
        self.snapshot_timeout_s = snapshot_timeout_s
        self._clock = clock
        self._subscriptions = Subscriptions(bus)
        self._snapshot_tasks: dict[str, asyncio.Task[None]] = {}
        self._shards: dict[str, float] = {}  # shard -> last heartbeat (our clock)
        self.metrics = IndexMetrics(registry)

    async def start(self) -> None:
        """Subscribe to the workers' and the store's event streams and the store's heartbeats."""
        subscribe = self._subscriptions.subscribe
        await subscribe("kv_events", subjects.kv_events_all(self.model), self.on_batch, message_type=KvEventBatch)
        await subscribe(
            "store_events", subjects.kvcache_events_all(), self.on_store_batch, message_type=KvStoreEventBatch
        )
        await subscribe(
            "store_heartbeats", subjects.kvcache_heartbeat_all(), self.on_store_heartbeat,
            message_type=KvStoreHeartbeat,
        )

    async def close(self) -> None:
        """Unsubscribe and stop every snapshot task."""
        for task in list(self._snapshot_tasks.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._snapshot_tasks.clear()
        await self._subscriptions.close()

    def on_member(self, member: Member) -> None:
        """A worker's heartbeat: index it; page its snapshot when it is new, restarted, or still owed one."""
        if self.index.observe_worker(member.worker_id, member.layout_id, member.epoch):
            self.request_snapshot(member.worker_id)

    def forget(self, worker_id: str) -> None:
        """A worker left: drop it from the index and stop paging it."""
        task = self._snapshot_tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self.index.remove_worker(worker_id)

    async def on_batch(self, batch: KvEventBatch, msg: IncomingMsg) -> None:
        """One worker's events; a gap or a new epoch starts a snapshot."""
        if self.membership.get(batch.worker_id) is None:
            return  # joins with its first heartbeat, then its snapshot covers these
        self.metrics.event_lag.set(max(0.0, time.time() - batch.ts))
        if self.index.apply_batch(batch):
            self.request_snapshot(batch.worker_id)

    async def on_store_batch(self, batch: KvStoreEventBatch, msg: IncomingMsg) -> None:
        """One store shard's events."""
        self._shards.setdefault(batch.shard, self._clock())
        self.index.apply_store_batch(batch)

    async def on_store_heartbeat(self, heartbeat: KvStoreHeartbeat, msg: IncomingMsg) -> None:
        """A store shard is alive."""
        self._shards[heartbeat.shard] = self._clock()

    def sweep(self) -> None:
        """Remove store shards silent for the worker lease; publish the index's size."""
        horizon_s = self._clock() - self.membership.lease_s
        for shard in [s for s, seen_s in self._shards.items() if seen_s <= horizon_s]:
            del self._shards[shard]
            self.index.remove_store_shard(shard)
            log.warning("kvcache shard lost: %s", shard)
        self.metrics.publish(self.index)

    def request_snapshot(self, worker_id: str) -> None:
        """Page the worker's snapshot on a task of its own (one per worker at a time)."""
        if worker_id in self._snapshot_tasks:
            return
        task = asyncio.create_task(self._sync(worker_id), name=f"kv-snapshot-{worker_id}")
        self._snapshot_tasks[worker_id] = task
        task.add_done_callback(lambda t: self._snapshot_done(worker_id, t))

    async def wait_synced(self) -> None:
        """Wait for the snapshots being paged (for tests)."""
        while self._snapshot_tasks:
            await asyncio.gather(*self._snapshot_tasks.values(), return_exceptions=True)

    def _snapshot_done(self, worker_id: str, task: asyncio.Task[None]) -> None:
        if self._snapshot_tasks.get(worker_id) is task:
            del self._snapshot_tasks[worker_id]

    async def _sync(self, worker_id: str) -> None:
        pause_s = SNAPSHOT_RETRY_S
        while self.membership.get(worker_id) is not None:
            if await self._page_snapshot(worker_id):
                self.metrics.snapshots.labels(outcome="ok").inc()
                return
            self.metrics.snapshots.labels(outcome="retried").inc()
            await asyncio.sleep(pause_s)
            pause_s = min(2 * pause_s, SNAPSHOT_RETRY_MAX_S)

    async def _page_snapshot(self, worker_id: str) -> bool:
        """One attempt: every page, then the held batches on top; False (entries dropped) on any failure."""
        if not self.index.begin_snapshot(worker_id):
            return False
        request = SnapshotRequest()
        subject = subjects.snapshot(self.model, worker_id)
        try:
            while True:
                page = await self.bus.request(subject, request, SnapshotPage, self.snapshot_timeout_s)
                if not self.index.apply_page(page):
                    raise ProtocolError(f"snapshot page of {worker_id} is from another cut")
                if page.next_cursor is None:
                    break
                request = SnapshotRequest(cursor=page.next_cursor, seq=page.seq)
        except (BusError, ProtocolError) as exc:
            log.info("snapshot of %s failed, retrying: %s", worker_id, exc)
            self.index.abort_snapshot(worker_id)
            return False
        return self.index.end_snapshot(worker_id)


class IndexMetrics:
    """The KV index's size and health on the scheduler's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.entries = gauge(registry, "scheduler_kv_index_entries", "(holder, block) entries in the KV index.")
        self.blocks = gauge(registry, "scheduler_kv_index_blocks", "Distinct (layout, block hash) in the KV index.")
        self.evicted = gauge(
            registry, "scheduler_kv_index_evicted", "Entries evicted by the index's cap since start."
        )
        self.gaps = gauge(registry, "scheduler_kv_event_gaps", "KV event gaps seen since start (each a resync).")
        self.epochs = gauge(registry, "scheduler_kv_worker_restarts", "New worker epochs seen since start.")
        self.event_lag = gauge(
            registry, "scheduler_kv_event_lag_seconds", "Age of the latest KV event batch (worker clock) on arrival."
        )
        self.snapshots = counter(registry, "scheduler_kv_snapshots", "Snapshot pagings by outcome.", ["outcome"])

    def publish(self, index: KvIndex) -> None:
        """Copy the index's counts."""
        self.entries.set(index.num_entries)
        self.blocks.set(index.num_blocks())
        self.evicted.set(index.num_evicted)
        self.gaps.set(index.num_gaps)
        self.epochs.set(index.num_epochs)
