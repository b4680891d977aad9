"""KvStore: the kvcache store's BlockProvider over a RAM tier and a disk tier, keyed by (layout_id, block_hash).

    write_blocks: append the new blocks to the segments (write-through) → index them on disk → hold them in RAM
    read_blocks:  RAM hit, else a disk hit (checksum verified) promoted to RAM, else BlockNotFound (all or nothing)
    has_blocks:   held and not expired (not a use)
    lease_blocks: (a shared-memory RAM tier only) read_blocks without the bytes: each block's slot in the region
                  that workers on this host map, held for them until release_lease (deepinfer.kvcache.shm);
                  via a transfer engine (serve_transfer_engine): the same slots for a reader on any host, which
                  copies them out of the region's registered memory with its own engine

Invariant: with a disk tier every RAM block is also on disk, so leaving RAM loses nothing, and leaving the disk
(eviction, expiry, a bad checksum) also drops the block from RAM. Two locks: the state lock guards every index,
the event buffer and the reads from disk (short: one block); the write lock makes one appender at a time
(write_blocks, touch records, compaction), which does its file I/O without the state lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from deepinfer.dataplane.errors import BlockNotFound, DataPlaneError
from deepinfer.dataplane.frames import BytesLike, LeaseVia, RemoteRegion
from deepinfer.host_identity import host_id
from deepinfer.kvcache.shm.region import PAGE, SHM_REGION_RECORD, replace_region_record
from deepinfer.kvcache.shm.tier import ShmRamTier, SlotLease
from deepinfer.kvcache.store.compaction import (
    CompactionProgress,
    choose_victim,
    copy_step,
    finish_step,
    plan_step,
)
from deepinfer.kvcache.store.disk import CorruptRecordError, DiskTier
from deepinfer.kvcache.store.events import EventBuffer, StoreEvent, StoreEventKind
from deepinfer.kvcache.store.metrics import StoreMetrics, Tier
from deepinfer.kvcache.store.ram import Key, RamTier, held_payload
from deepinfer.kvcache.store.records import MAX_KEY_PART_BYTES, record_bytes
from deepinfer.kvcache.store.scan import CorruptReason
from deepinfer.kvcache.store.settings import StoreSettings

if TYPE_CHECKING:
    from deepinfer.dataplane.transfer_engine import TransferEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreStats:
    """What the store holds now."""

    num_ram_blocks: int
    ram_bytes: int
    num_disk_blocks: int
    #: Bytes of the live disk records (what disk_bytes bounds) and of the segment files (dead bytes included).
    disk_live_bytes: int
    disk_file_bytes: int
    num_segments: int


class KvStore:
    """A thread-safe BlockProvider of immutable blocks by (layout_id, block_hash), RAM then disk, TTL since use.

    Lifecycle: `KvStore(settings)` rebuilds the disk index from the segments (and holds the directory's lock) →
    serve (`read_blocks` / `write_blocks` / `has_blocks`, from any thread) while the owner calls `expire()`,
    `compact_step()` and `take_events()` periodically → `close()` (syncs, releases the directory).
    `clock` gives wall-clock seconds (last uses survive restarts); inject one in tests.
    """

    #: One put may come as several write_blocks calls (deepinfer.dataplane.puts); each is complete on its own.
    incremental_writes = True

    def __init__(
        self,
        settings: StoreSettings,
        *,
        clock: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = StoreMetrics(registry if registry is not None else CollectorRegistry())
        self._clock = clock
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        #: Where this store runs: only a reader with the same host id is leased shared-memory slots.
        self.host_id = host_id()
        self._disk = DiskTier(settings, clock()) if settings.disk_dir is not None else None  # takes the LOCK
        self._ram: RamTier | ShmRamTier = RamTier(settings.ram_bytes)
        if settings.shm_dir is not None and settings.ram_bytes > 0:
            try:
                self._ram = self._open_shm_tier(settings)
            except BaseException:
                if self._disk is not None:
                    self._disk.close()
                raise
        self._events = EventBuffer(settings.max_pending_events)
        self._pending_touches: set[Key] = set()
        self._closed = False
        #: The engine the region is registered with, and what a transfer-engine lease names (serve_transfer_engine).
        self._transfer_engine: TransferEngine | None = None
        self._remote_region: RemoteRegion | None = None
        if self._disk is not None:
            self.metrics.opened(self._disk.open_report)
        self._update_usage()

    # -- BlockProvider ----------------------------------------------------------------------------------------
    def read_blocks(
        self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes], layout_id: str
    ) -> list[BytesLike]:
        """Payloads (bytes, read-only views) in request order; BlockNotFound (nothing served) unless all are held."""
        if block_ids:
            raise DataPlaneError("the kvcache store serves blocks by hash, not by owner-local block id")
        keys = self._all_held(layout_id, block_hashes)
        payloads = [self._read_one(key) for key in keys]
        self._try_flush_touches()
        lost = [key for key, payload in zip(keys, payloads, strict=True) if payload is None]
        if lost:  # evicted, expired or found corrupt since the check above
            raise _not_found(layout_id, lost)
        return payloads  # type: ignore[return-value]  # no None left

    def write_blocks(
        self, layout_id: str, block_hashes: Sequence[bytes], payloads: Sequence[BytesLike],
        checksums: Sequence[int] | None = None,
    ) -> None:
        """Hold the blocks (a block already held only counts as a use: blocks are immutable); `checksums`, when
        given, are the payloads' xxh3-64 the caller verified (the data plane). Payloads as in `held_payload`."""
        _check_layout_id(layout_id)
        sums: Sequence[int | None] = [None] * len(payloads) if checksums is None else checksums
        if not len(block_hashes) == len(payloads) == len(sums):
            raise DataPlaneError(f"{len(block_hashes)} hashes, {len(payloads)} payloads, {len(sums)} checksums")
        items: dict[Key, tuple[BytesLike, int | None]] = {}
        for block_hash, payload, known in zip(block_hashes, payloads, sums, strict=True):
            items.setdefault((layout_id, bytes(block_hash)), (held_payload(payload), known))
        with self._write_lock:
            with self._lock:
                self._check_open()
                now = self._clock()
                fresh = [(key, *item) for key, item in items.items() if not self._refresh(key, now)]
            if fresh:
                self._store_new(fresh, now)
            self._flush_touches()

    def has_blocks(self, layout_id: str, block_hashes: Sequence[bytes]) -> list[bool]:
        """One flag per hash: held under this layout and not expired (a probe, not a use)."""
        with self._lock:
            self._check_open()
            now = self._clock()
            return [self._holds((layout_id, bytes(h)), now, expire=False) for h in block_hashes]

    # -- shared memory (workers on this host) ----------------------------------------------------------------
    @staticmethod
    def _open_shm_tier(settings: StoreSettings) -> ShmRamTier:
        assert settings.shm_dir is not None
        if settings.disk_dir is not None:  # the directory's owner (it holds LOCK) removes a killed predecessor's
            replace_region_record(settings.disk_dir / SHM_REGION_RECORD, None)
        tier = ShmRamTier(settings.ram_bytes, settings.shm_dir, settings.shm_slot_bytes, settings.shm_lease_s)
        if settings.disk_dir is not None:
            replace_region_record(settings.disk_dir / SHM_REGION_RECORD, tier.region.path)
        return tier

    @property
    def shm_enabled(self) -> bool:
        """The RAM tier is a shared-memory region that workers on this host may lease slots of."""
        return isinstance(self._ram, ShmRamTier)

    def serve_transfer_engine(self, engine: TransferEngine) -> None:
        """Register the slot region with this process's transfer engine: leases `via` it then name the region's
        addresses in that engine, for readers on any host. Needs the slot RAM tier (`shm_dir`)."""
        if not isinstance(self._ram, ShmRamTier):
            raise ValueError("transfer-engine reads need the RAM tier in a slot region (shm_dir / shm_ram)")
        region = self._ram.region
        engine.register(region.address, region.layout.size_bytes)
        self._transfer_engine = engine
        self._remote_region = RemoteRegion(session_id=engine.session_id, headers_address=region.address + PAGE,
                                           slots_address=region.address + region.layout.data_offset,
                                           slot_bytes=region.layout.slot_bytes)

    @property
    def transfer_engine_enabled(self) -> bool:
        """Leases via a transfer engine are served (readers on other hosts)."""
        return self._remote_region is not None

    def lease_blocks(self, layout_id: str, block_hashes: Sequence[bytes], host_id: str,
                     via: LeaseVia = LeaseVia.SHARED_MEMORY) -> SlotLease:
        """Every block's slot in the shared-memory region, leased (a use, like a get; blocks on disk only are
        promoted first). Raises DataPlaneError for a shared-memory reader on another host, a transfer-engine
        reader of a store that serves none, or a store without the region; BlockNotFound unless every block is
        held, and in shared memory at the end (the reader then gets)."""
        if not isinstance(self._ram, ShmRamTier):
            raise DataPlaneError("this kvcache store keeps no RAM tier in shared memory")
        if via == LeaseVia.TRANSFER_ENGINE:
            if self._remote_region is None:
                raise DataPlaneError("this kvcache store serves no transfer-engine reads")
        elif host_id != self.host_id:
            raise DataPlaneError(f"shared memory is for readers on host {self.host_id!r}, not {host_id!r}")
        keys = self._all_held(layout_id, block_hashes)
        for key in keys:
            self._read_one(key, copy=False)
        self._try_flush_touches()
        with self._lock:
            self._check_open()
            lease = self._ram.lease(keys)
        if lease is None:
            raise BlockNotFound(f"{len(keys)} block(s) of layout {layout_id!r} are not all in shared memory")
        if via == LeaseVia.TRANSFER_ENGINE:
            return dataclasses.replace(lease, remote_region=self._remote_region)
        return lease

    def release_lease(self, lease_id: str) -> None:
        """A reader is done with a lease: its slots may be rewritten (an unknown or ended lease: nothing)."""
        if isinstance(self._ram, ShmRamTier):
            with self._lock:
                self._ram.release(lease_id)

    # -- the owner's periodic work ---------------------------------------------------------------------------
    def expire(self) -> int:
        """Drop every block unused for more than ttl_s from every tier; how many were dropped."""
        with self._lock:
            self._check_open()
            now = self._clock()
            expired = (
                self._disk.expired(now)
                if self._disk is not None
                else self._ram.expired(now, self.settings.ttl_s)
            )
            for key in expired:
                self._drop(key, now, StoreEventKind.EXPIRED)
            self._update_usage()
        return len(expired)

    def compact_step(self) -> CompactionProgress:
        """One bounded compaction step (at most compact_step_bytes copied); readers wait only for its edges."""
        if self._disk is None:
            return CompactionProgress()
        with self._write_lock:
            self._flush_touches()
            with self._lock:
                self._check_open()
                plan = plan_step(self._disk, self.settings.compact_step_bytes)
            if plan is None:
                return CompactionProgress()
            copied = copy_step(self._disk, plan)
            with self._lock:
                for key in copied.corrupt:
                    self._drop_corrupt(key)
                reclaimed = finish_step(self._disk, plan, copied)
                self.metrics.compacted_bytes.inc(reclaimed)
                self._update_usage()
                done = choose_victim(self._disk) is None
        return CompactionProgress(copied.copied_bytes, reclaimed, done)

    def compact(self) -> CompactionProgress:
        """Compaction steps until no segment qualifies; the totals."""
        copied = reclaimed = 0
        while True:
            step = self.compact_step()
            copied, reclaimed = copied + step.copied_bytes, reclaimed + step.reclaimed_bytes
            if step.done:
                return CompactionProgress(copied, reclaimed, True)

    def take_events(self) -> list[StoreEvent]:
        """Stored / expired / evicted events since the last call, oldest first."""
        with self._lock:
            return self._events.take()

    @property
    def num_dropped_events(self) -> int:
        """Events dropped because the buffer was full (the owner should republish a snapshot)."""
        return self._events.num_dropped

    def stats(self) -> StoreStats:
        """What each tier holds now."""
        with self._lock:
            disk = self._disk
            return StoreStats(
                num_ram_blocks=len(self._ram),
                ram_bytes=self._ram.used_bytes,
                num_disk_blocks=0 if disk is None else len(disk),
                disk_live_bytes=0 if disk is None else disk.live_bytes,
                disk_file_bytes=0 if disk is None else disk.log.file_bytes,
                num_segments=0 if disk is None else len(disk.log.sizes()),
            )

    def held_keys(self, tier: Tier) -> list[Key]:
        """(layout_id, block_hash) of every block a tier holds, least recently used first (for snapshots)."""
        with self._lock:
            if tier == Tier.RAM:
                return self._ram.keys()
            return [] if self._disk is None else self._disk.keys()

    def close(self) -> None:
        """Write pending touches, sync and close the segments, release the directory; idempotent."""
        with self._write_lock:
            if self._closed:
                return
            self._flush_touches()
            with self._lock:
                self._closed = True
                if self._disk is not None:
                    self._disk.close()
                if isinstance(self._ram, ShmRamTier):
                    if self._transfer_engine is not None:  # before the unmap: the engine must not serve it
                        self._transfer_engine.unregister(self._ram.region.address)
                        self._remote_region = None
                    self._ram.close()

    def __enter__(self) -> KvStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- reads (state lock) ----------------------------------------------------------------------------------
    def _holds(self, key: Key, now: float, *, expire: bool) -> bool:
        """Held and not expired; with `expire`, an expired block is dropped on the way."""
        entry = self._disk.get(key) if self._disk is not None else self._ram.get(key)
        if entry is None:
            return False
        if now - entry.last_used_s <= self.settings.ttl_s:
            return True
        if expire:
            self._drop(key, now, StoreEventKind.EXPIRED)
        return False

    def _read_one(self, key: Key, *, copy: bool = True) -> BytesLike | None:
        """The block's payload (RAM, else disk promoted to RAM); None when it left meanwhile. `copy=False`: a RAM
        hit is only counted (b"" returned): the caller leases its slot."""
        with self._lock:
            self._check_open()
            now, start_s = self._clock(), time.perf_counter()
            ram_entry = self._ram.get(key)
            if ram_entry is not None:
                age_s = now - ram_entry.last_used_s
                self._use(key, now)
                self.metrics.hit(Tier.RAM, age_s, time.perf_counter() - start_s)
                return self._ram.payload(key) if copy else b""
            self.metrics.misses.labels(tier=Tier.RAM).inc()
            if self._disk is None:
                return None  # evicted since the check in read_blocks
            disk_entry = self._disk.get(key)
            if disk_entry is None:
                self.metrics.misses.labels(tier=Tier.DISK).inc()
                return None
            try:
                payload = self._disk.read_payload(disk_entry)
            except CorruptRecordError as exc:
                logger.warning("kvstore: block %s of layout %s not served: %s", key[1].hex(), key[0], exc)
                self._drop_corrupt(key)
                self.metrics.misses.labels(tier=Tier.DISK).inc()
                return None
            age_s = now - disk_entry.last_used_s
            self._use(key, now)
            self._on_ram_evicted(self._ram.put(key, payload, now), now)  # promote
            self.metrics.hit(Tier.DISK, age_s, time.perf_counter() - start_s)
            self._update_usage()
            return payload

    def _use(self, key: Key, now: float) -> None:
        if key in self._ram:
            self._ram.use(key, now)
        if self._disk is not None and key in self._disk and self._disk.use(key, now):
            self._pending_touches.add(key)

    def _refresh(self, key: Key, now: float) -> bool:
        """A put of a block already held: count the use; False when the block is not held (or expired)."""
        if not self._holds(key, now, expire=True):
            return False
        self._use(key, now)
        return True

    def _count_misses(self, keys: list[Key]) -> None:
        self.metrics.misses.labels(tier=Tier.RAM).inc(len(keys))
        if self._disk is not None:
            self.metrics.misses.labels(tier=Tier.DISK).inc(len(keys))

    # -- writes ----------------------------------------------------------------------------------------------
    def _store_new(self, fresh: list[tuple[Key, BytesLike, int | None]], now: float) -> None:
        """Under the write lock: append the new blocks (no state lock), then index and announce them."""
        start_s = time.perf_counter()
        largest = max(len(payload) for _, payload, _ in fresh)
        if self._disk is None:
            if largest > self.settings.ram_bytes:
                raise DataPlaneError(
                    f"a block of {largest} bytes exceeds ram_bytes={self.settings.ram_bytes}"
                )
            with self._lock:
                for key, payload, _ in fresh:
                    self._on_ram_evicted(self._ram.put(key, payload, now), now)
                    self._events.add(StoreEventKind.STORED, key[0], key[1], now)
                self.metrics.write_seconds.labels(tier=Tier.RAM).observe(time.perf_counter() - start_s)
                self._update_usage()
            return
        largest_record = max(record_bytes(key, payload) for key, payload, _ in fresh)
        if largest_record > self.settings.disk_bytes:
            raise DataPlaneError(
                f"a record of {largest_record} bytes exceeds disk_bytes={self.settings.disk_bytes}"
            )
        appended = self._disk.append_blocks([(key, payload, now, known) for key, payload, known in fresh])
        write_s = time.perf_counter() - start_s
        with self._lock:
            for block, (key, payload, _) in zip(appended, fresh, strict=True):
                for evicted in self._disk.insert(block, now):
                    self._drop(evicted, now, StoreEventKind.EVICTED, left_disk=True)
                self._on_ram_evicted(self._ram.put(key, payload, now), now)
                self._events.add(StoreEventKind.STORED, key[0], key[1], now)
            self.metrics.write_seconds.labels(tier=Tier.DISK).observe(write_s)
            self._update_usage()

    def _flush_touches(self) -> None:
        """Under the write lock: write the due touch records (the durable last use of recently used blocks)."""
        if self._disk is None or not self._pending_touches:
            return
        with self._lock:
            due = [
                (key, entry.last_used_s) for key in self._pending_touches if (entry := self._disk.get(key))
            ]
            self._pending_touches.clear()
        if due:
            appended = self._disk.append_touches(due)
            with self._lock:
                for touch in appended:
                    self._disk.record_touch(touch)

    def _try_flush_touches(self) -> None:
        """Flush touches unless a writer holds the write lock (it flushes them itself before releasing it)."""
        if self._pending_touches and self._write_lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._flush_touches()
            finally:
                self._write_lock.release()

    # -- drops (state lock) ----------------------------------------------------------------------------------
    def _drop(self, key: Key, now: float, kind: StoreEventKind, *, left_disk: bool = False) -> None:
        """Remove a block from every tier (`left_disk`: the disk index let it go already), count and announce it."""
        counter = self.metrics.expirations if kind == StoreEventKind.EXPIRED else self.metrics.evictions
        if self._ram.remove(key):
            counter.labels(tier=Tier.RAM).inc()
        if left_disk or (self._disk is not None and self._disk.remove(key)):
            counter.labels(tier=Tier.DISK).inc()
        self._pending_touches.discard(key)
        self._events.add(kind, key[0], key[1], now)

    def _drop_corrupt(self, key: Key) -> None:
        self.metrics.corrupt_records.labels(reason=CorruptReason.CHECKSUM).inc()
        self._drop(key, self._clock(), StoreEventKind.EVICTED)

    def _on_ram_evicted(self, keys: Iterable[Key], now: float) -> None:
        """Blocks the RAM tier let go: still on disk (a metric only), or gone from a RAM-only store."""
        for key in keys:
            self.metrics.evictions.labels(tier=Tier.RAM).inc()
            if self._disk is None:
                self._pending_touches.discard(key)
                self._events.add(StoreEventKind.EVICTED, key[0], key[1], now)

    # -- bookkeeping -----------------------------------------------------------------------------------------
    def _all_held(self, layout_id: str, block_hashes: Sequence[bytes]) -> list[tuple[str, bytes]]:
        """The blocks' keys, in order, when every one is held (expired ones dropped); else BlockNotFound naming
        the missing ones, counted as misses."""
        keys = [(layout_id, bytes(h)) for h in block_hashes]
        with self._lock:
            self._check_open()
            now = self._clock()
            missing = [key for key in keys if not self._holds(key, now, expire=True)]
            if missing:
                self._count_misses(missing)
        if missing:
            raise _not_found(layout_id, missing)
        return keys

    def _check_open(self) -> None:
        if self._closed:
            raise DataPlaneError("the kvcache store is closed")

    def _update_usage(self) -> None:
        self.metrics.usage(Tier.RAM, len(self._ram), self._ram.used_bytes)
        if self._disk is not None:
            self.metrics.usage(Tier.DISK, len(self._disk), self._disk.live_bytes)
            self.metrics.disk_file_bytes.set(self._disk.log.file_bytes)


def _check_layout_id(layout_id: str) -> None:
    if not 0 < len(layout_id.encode()) <= MAX_KEY_PART_BYTES:
        raise DataPlaneError(
            f"the store keys blocks by layout_id: 1..{MAX_KEY_PART_BYTES} bytes, got {layout_id!r}"
        )


def _not_found(layout_id: str, missing: list[Key]) -> BlockNotFound:
    return BlockNotFound(
        f"{len(missing)} block(s) not held under layout {layout_id!r}, first {missing[0][1].hex()}"
    )
