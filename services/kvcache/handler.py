"""A kvcache store shard. What it does:

    data plane                 get / put / has by (layout_id, hash) ──► KvStore (RAM, then disk; docs/kvstore.md)
                               lease / release (shm_ram): a worker on this host reads the RAM tier's shared memory;
                               with transfer_engine, a worker on any host copies it through Mooncake Transfer Engine
    di.kvcache.<shard>.lookup  KvLookupRequest ──► KvLookupReply (has, under the request's layout)
    every maintenance interval expire → one compaction step → publish what was stored / expired / evicted
                               (one KvStoreEventBatch per layout on di.kvcache.events.<shard>, seq +1 each)
    every heartbeat interval   KvStoreHeartbeat on di.kvcache.heartbeat.<shard> (clients derive the shard set)

The store does disk I/O: every call into it runs on a worker thread (the data plane's own, or asyncio's), never
on the event loop. A restart (kill -9 included) loses nothing a put was acknowledged for: the index is rebuilt
from the segment files when the store opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from deepinfer import subjects
from deepinfer.bus import IncomingMsg, Subscriptions
from deepinfer.config import KvCacheSettings
from deepinfer.dataplane import DataPlaneServer
from deepinfer.dataplane.transfer_engine import TransferEngine
from deepinfer.kvcache.store import KvStore, StoreEvent, StoreEventKind, StoreSettings
from deepinfer.protocol import KvLookupReply, KvLookupRequest, KvStoreEventBatch, KvStoreHeartbeat
from deepinfer.service import ServiceContext

log = logging.getLogger(__name__)

#: Most block hashes in one KvStoreEventBatch: 32k hashes of 16 bytes stay well under NATS' 1 MiB payload.
MAX_EVENT_HASHES = 32768


def store_settings(settings: KvCacheSettings) -> StoreSettings:
    """The storage engine's knobs from the service's settings."""
    return StoreSettings(
        ram_bytes=int(settings.ram_bytes),
        disk_dir=settings.resolved_disk_dir(),
        disk_bytes=int(settings.disk_bytes),
        ttl_s=settings.ttl_s,
        fsync=settings.fsync,
        shm_dir=settings.shm_dir if settings.shm_ram else None,
        shm_slot_bytes=int(settings.shm_slot_bytes),
    )


class KvCacheHandler:
    """One store shard; a `deepinfer.service.Handler`."""

    def __init__(self, ctx: ServiceContext[KvCacheSettings]) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.bus = ctx.bus
        self.shard = ctx.settings.shard
        self.store: KvStore | None = None
        self.data_plane: DataPlaneServer | None = None
        self.draining = False
        self.num_heartbeats = 0
        self._seq = 0
        self._subscriptions = Subscriptions(ctx.bus)
        self._loops: list[asyncio.Task[None]] = []

    # -- lifecycle ----------------------------------------------------------------------------------------------
    async def open(self) -> None:
        """Open the store (rebuilding its index from disk) and bind the data plane."""
        started_s = time.perf_counter()
        self.store = await asyncio.to_thread(KvStore, store_settings(self.settings), registry=self.ctx.registry)
        stats = self.store.stats()
        log.info("store opened in %.2f s: %d blocks on disk (%d bytes), %s", time.perf_counter() - started_s,
                 stats.num_disk_blocks, stats.disk_live_bytes, self.settings.resolved_disk_dir())
        secret = self.settings.common.data_plane_secret
        self.data_plane = DataPlaneServer(
            self.store, host=self.settings.data_plane_host, port=self.settings.data_plane_port,
            secret=secret.get_secret_value() if secret else None,
        )
        await self.data_plane.start()
        if self.settings.transfer_engine:  # registers the region: leases via the engine name its addresses
            engine = await asyncio.to_thread(TransferEngine.shared, self.settings.data_plane_host,
                                             self.settings.transfer_engine_protocol)
            self.store.serve_transfer_engine(engine)
            log.info("transfer engine %s (%s) serves the RAM tier", engine.session_id, engine.protocol)

    async def start(self) -> None:
        """Answer lookups; heartbeat now and then every interval; start the maintenance loop."""
        await self._subscriptions.subscribe(
            "lookup", subjects.kvcache_lookup(self.shard), self._on_lookup, message_type=KvLookupRequest
        )
        await self.heartbeat()
        self._loops = [
            asyncio.create_task(self._every(self.settings.heartbeat_interval_s, self.heartbeat), name="heartbeat"),
            asyncio.create_task(self._every(self.settings.maintenance_interval_s, self.maintain), name="maintain"),
        ]

    def is_ready(self) -> bool:
        """Store open, data plane bound, announced, not draining."""
        return self.not_ready_reason() == ""

    def not_ready_reason(self) -> str:
        """Why not ready ("" when ready)."""
        if self.store is None or self.data_plane is None:
            return "opening the store"
        if self.draining:
            return "draining"
        return "" if self.num_heartbeats else "announcing"

    async def drain(self, grace_s: float) -> None:
        """Announce draining, then publish what the store did since the last maintenance."""
        self.draining = True
        with contextlib.suppress(Exception):
            await self.heartbeat()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.publish_events(), timeout=max(0.1, grace_s))

    async def close(self) -> None:
        """Stop the loops and lookups, close the data plane (in-flight requests finish), close the store."""
        for task in self._loops:
            task.cancel()
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._loops.clear()
        await self._subscriptions.close()
        if self.data_plane is not None:
            await self.data_plane.close(drain_timeout_s=5.0)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    # -- the work -----------------------------------------------------------------------------------------------
    async def _on_lookup(self, request: KvLookupRequest, msg: IncomingMsg) -> None:
        assert self.store is not None
        present = await asyncio.to_thread(self.store.has_blocks, request.layout_id, request.block_hashes)
        await self.bus.reply(msg, KvLookupReply(present=list(present)))

    async def heartbeat(self) -> None:
        """Publish one KvStoreHeartbeat with the store's current size."""
        assert self.store is not None and self.data_plane is not None
        stats = self.store.stats()
        beat = KvStoreHeartbeat(
            shard=self.shard, data_plane_address=self.data_plane.address, internal_address=self.ctx.internal_address,
            num_blocks=stats.num_disk_blocks or stats.num_ram_blocks, ram_bytes=stats.ram_bytes,
            ram_capacity_bytes=int(self.settings.ram_bytes), disk_bytes=stats.disk_live_bytes,
            disk_capacity_bytes=int(self.settings.disk_bytes), draining=self.draining, ts=time.time(),
            host_id=self.store.host_id, shm=self.store.shm_enabled,
            transfer_engine=self.store.transfer_engine_enabled,
        )
        await self.bus.publish(subjects.kvcache_heartbeat(self.shard), beat)
        self.num_heartbeats += 1

    async def maintain(self) -> None:
        """Expire, take one bounded compaction step, publish the events."""
        assert self.store is not None
        await asyncio.to_thread(self.store.expire)
        await asyncio.to_thread(self.store.compact_step)
        await self.publish_events()

    async def publish_events(self) -> None:
        """What the store stored, expired and evicted since the last call: batches per layout, seq +1 each."""
        assert self.store is not None
        events = self.store.take_events()
        for batch in event_batches(self.shard, events, self._seq):
            await self.bus.publish(subjects.kvcache_events(self.shard), batch)
            self._seq = batch.seq

    async def _every(self, interval_s: float, work) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await work()
            except Exception:  # one failed round must not stop heartbeats or maintenance for good
                log.warning("%s failed", getattr(work, "__name__", "periodic work"), exc_info=True)


def event_batches(shard: str, events: list[StoreEvent], last_seq: int) -> list[KvStoreEventBatch]:
    """Events grouped per layout, seq continuing last_seq. A hash appears at most once per batch (a block stored
    then evicted in one interval spans two batches), so a reader may apply a batch's lists in any order."""
    open_batches: dict[str, tuple[KvStoreEventBatch, set[bytes]]] = {}
    batches: list[KvStoreEventBatch] = []
    seq, now = last_seq, time.time()
    for event in events:
        batch, seen = open_batches.get(event.layout_id, (None, set()))
        if batch is None or event.block_hash in seen or len(seen) >= MAX_EVENT_HASHES:
            seq += 1
            batch, seen = KvStoreEventBatch(shard=shard, seq=seq, layout_id=event.layout_id, ts=now), set()
            open_batches[event.layout_id] = (batch, seen)
            batches.append(batch)
        seen.add(event.block_hash)
        _LISTS[event.kind](batch).append(event.block_hash)
    return batches


#: The list of a batch that holds each kind of event.
_LISTS = {
    StoreEventKind.STORED: lambda batch: batch.stored_block_hashes,
    StoreEventKind.EXPIRED: lambda batch: batch.expired_block_hashes,
    StoreEventKind.EVICTED: lambda batch: batch.evicted_block_hashes,
}
