"""`StoreTier`: a worker's use of the kvcache store (docs/kvstore.md, "Workers").

    admission   hashes of the request's full blocks past those the device or the host tier holds, when a store
                block loads faster than this worker computes one (deepinfer.kv_costs, at the measured rates) ─ has
                (lookup_timeout_s; coalesced with the requests that arrive together: StoreLookups) ─► s stored
                (a leading run) ─► n = the prefix worth loading of [device | host | store s]
                n within device + host: AddRequest, computed (the engine's admission loads the host part)
                n past them: AddRequest with StoredKv(n) → WAITING_FOR_REMOTE_KVS (the engine steps the others); then
                       per chunk of a StagingPool's rows (load_staged): the host-held blocks copied in, the rest
                       ─ get into the rows (checksums verified) ─► engine thread: ImportChunk (one scatter_blocks)
                       while the loop receives the next chunk ─► CompleteLoad: runs from its first token not loaded
                       a failed or late get (load_timeout_s) ─► FailLoad: recomputed, the blocks never served
                       a completed load: its store bytes and seconds are a sample of the store path's rate
                       (STORE_SHM when every live shard is same-host shared memory, else STORE)
    write-behind  prompt blocks entering the cache (generated blocks too with kv_store_write_generated): with
                the host tier, its Stored events (the block's host slot is written); without, the device's
                ─► bounded queue (full: dropped, counted) ─► background task: has → on the engine thread between
                steps, the missing ones still cached: host tier on, their slots pinned and read-only views of
                them handed out (no copy, no device work); off, exported from the device (evicted ones are
                dropped, counted) → put to their shards from the views (event loop) → the slots released

Blocks are keyed by (layout_id, block hash), the hash chain of deepinfer.hashing that the gateway and
scheduler use. With no live shard, or `kv_store` off, nothing here touches the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from prometheus_client import CollectorRegistry

from deepinfer.bus import MessageBus
from deepinfer.config import WorkerSettings
from deepinfer.engine import (
    DEVICE_TIER,
    HOST_TIER,
    AddRequest,
    Admission,
    CompleteLoad,
    CudaRegistrar,
    DeviceRows,
    Engine,
    EngineOutput,
    EngineRequest,
    FailLoad,
    ImportChunk,
    KvCacheEvent,
    LoadPlan,
    NewStagingPool,
    PinCached,
    StagingChunk,
    StagingPool,
    Stored,
    StoredKv,
)
from deepinfer.hashing import hash_blocks
from deepinfer.kv_costs import DEVICE, HOST, STORE
from deepinfer.kv_rates import STORE_SHM
from deepinfer.kvcache.client import KvStoreClient, KvTransport
from deepinfer.telemetry import counter, gauge, histogram
from deepinfer.worker.engine_loop import EngineLoop
from deepinfer.worker.slot_copies import ChunkSlotCopies
from deepinfer.worker.store_lookup import StoreLookups

log = logging.getLogger(__name__)

#: Block hashes remembered as held by the store (loaded, found or written): not written behind again.
KNOWN_HASHES = 1 << 16


class StoreTier:
    """Loads stored prefixes at admission and writes full blocks behind, for one worker's engine."""

    def __init__(self, settings: WorkerSettings, registry: CollectorRegistry, engine: Engine, engine_loop: EngineLoop,
                 client: KvStoreClient):
        self.settings = settings
        #: The engine's front door (its hints, read on the event loop) and the thread its commands run on.
        self.engine, self.engine_loop = engine, engine_loop
        self.layout_id = engine.kv_layout.layout_id()
        self.block_size, self.fingerprint = engine.block_size, engine.fingerprint
        self.client = client
        self._queue: deque[bytes] = deque()
        self._known: OrderedDict[bytes, None] = OrderedDict()
        #: Full prompt blocks of admitted requests: what write-behind writes (unless kv_store_write_generated).
        self._prompt_blocks: OrderedDict[bytes, None] = OrderedDict()
        self._wake = asyncio.Event()
        self._writing = False
        self._writer: asyncio.Task[None] | None = None
        self._staging: StagingPool | None = None
        #: On CUDA, same-host shared-memory slots are copied straight to the device (kv_store_shm_dma); the
        #: region is mapped and registered once, in the background, at the first admission that sees it.
        self._prepare: asyncio.Task[int] | None = None
        if settings.kv_store_shm_dma and engine.device.type == "cuda":
            client.shared_memory.use_device(CudaRegistrar(engine.device), settings.kv_store_shm_verify_checksums)
        self._metrics(registry)
        #: The admission lookups, coalesced: requests that arrive together ask in one round trip.
        self.lookups = StoreLookups(client, self.layout_id, settings.kv_store_lookup_timeout_s, self.m_lookups,
                                    self.m_lookup_round_trips)

    def _metrics(self, registry: CollectorRegistry) -> None:
        self.m_lookups = counter(registry, "worker_store_lookups", "Store lookups at admission by result (hit, "
                                 "miss, error; skipped: fewer uncached tokens than kv_store_min_lookup_tokens; "
                                 "slower: the store loads a block slower than this worker computes it).",
                                 ["result"])
        self.m_lookups_skipped = self.m_lookups.labels("skipped")  # per admission: `labels` builds its key each call
        self.m_lookups_slower = self.m_lookups.labels("slower")
        self.m_lookup_round_trips = counter(
            registry, "worker_store_lookup_round_trips",
            "Store lookups sent at admission (each one `has` for every request waiting, coalesced).")
        self.m_loads = counter(registry, "worker_store_loads", "Loads from the store by outcome.", ["outcome"])
        self.m_loaded_blocks = counter(registry, "worker_store_loaded_blocks", "Blocks loaded from the store.")
        self.m_loaded_bytes = counter(registry, "worker_store_loaded_bytes", "Bytes loaded from the store.")
        self.m_shm_blocks = counter(registry, "worker_store_shm_blocks",
                                    "Blocks read from a same-host shard's shared memory (not the socket).")
        self.m_shm_fallbacks = counter(registry, "worker_store_shm_fallbacks",
                                       "Same-host gets that fell back from shared memory to the data plane.")
        self.m_shm_device_blocks = counter(registry, "worker_store_shm_device_blocks",
                                           "Of those, blocks copied straight to the device (DMA from the "
                                           "registered region, never through the CPU).")
        self._shm_counted = (0, 0, 0)
        self.m_te_blocks = counter(registry, "worker_store_transfer_engine_blocks",
                                   "Blocks read from a shard's slots through Mooncake Transfer Engine.")
        self.m_te_fallbacks = counter(registry, "worker_store_transfer_engine_fallbacks",
                                      "Transfer-engine gets that fell back to the data plane.")
        self._te_counted = (0, 0)
        self.m_load_s = histogram(registry, "worker_store_load_seconds", "A load: get and import of its blocks.")
        self.m_written_blocks = counter(registry, "worker_store_written_blocks", "Blocks written behind.")
        self.m_written_bytes = counter(registry, "worker_store_written_bytes", "Bytes written behind.")
        self.m_write_s = histogram(registry, "worker_store_write_seconds", "A write-behind put of one batch.")
        self.m_dropped = counter(registry, "worker_store_write_dropped_blocks",
                                 "Blocks not written behind, by reason (queue_full, evicted, error).", ["reason"])
        self.m_queue = gauge(registry, "worker_store_write_queue_blocks", "Blocks waiting to be written behind.")

    async def start(self) -> None:
        """Allocate the loads' staging on the engine thread (pinned on CUDA, with the engine's device bound: a
        one-time allocation kept off the event loop and off the first load), then start the write-behind task."""
        if self._staging is None:
            self._staging = await self.engine_loop.call(NewStagingPool())
        self.client.transfer_engine.register_ranges(self._staging.host_ranges)  # when (if) its engine starts
        self._writer = asyncio.create_task(self._write_loop(), name="store-write-behind")

    async def flush(self, timeout_s: float) -> None:
        """Wait (up to timeout_s) until the write-behind queue is empty."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while (self._queue or self._writing) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Stop writing behind (what is queued is dropped) and looking up (waiting admissions: misses); close
        the client."""
        await self.lookups.close()
        for task in (self._writer, self._prepare):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.client.close()

    # -- admission ----------------------------------------------------------------------------------------------
    async def add_request(self, request: EngineRequest) -> Admission:
        """Admit a request to compute, its stored prefix loaded instead of recomputed where the store has it.
        ValueError for an invalid request, like Engine.add_request."""
        if request.sampling_params.prompt_logprobs is not None:  # computed whole: stored KV has no logits
            return await self.engine_loop.call(AddRequest(request))
        tokens = [*request.prompt_token_ids, *request.output_token_ids]
        hashes = hash_blocks(tokens, self.block_size, self.fingerprint, request.cache_salt)[
            : (len(tokens) - 1) // self.block_size]
        self._remember(hashes, self._prompt_blocks)
        # Ask the store only about blocks past the prefix the device or the host tier holds: a prompt held here
        # (the next turn of a conversation, a shared system prompt) costs no round trip before it reaches the
        # engine, whose admission loads the host-held part itself. And only when they are worth a round trip
        # (kv_store_min_lookup_tokens: a short rest is recomputed) and the store loads a block faster than this
        # worker computes it (else the whole rest is recomputed: a slower last run never pays for itself).
        num_device, num_host = self.engine.cached_prefix_tiers(hashes)
        num_local = num_device + num_host
        beyond = hashes[num_local:]
        path = self.store_path()
        if path == STORE_SHM and self._prepare is None and self.client.shared_memory.registrar is not None:
            self._prepare = asyncio.create_task(self.client.prepare_shared_memory(self.layout_id),
                                                name="store-shm-register")
        costs = self.engine.kv_costs(path)
        if beyond and len(beyond) * self.block_size < self.settings.kv_store_min_lookup_tokens:
            self.m_lookups_skipped.inc()  # recomputing this little costs less than asking
            beyond = []
        elif beyond and not costs.worth_loading(STORE):
            self.m_lookups_slower.inc()
            beyond = []
        num_beyond = await self.lookups.leading(beyond)
        if not num_beyond:
            return await self.engine_loop.call(AddRequest(request))
        num_load = costs.blocks_to_load([(DEVICE, num_device), (HOST, num_host), (STORE, num_beyond)])
        num_store_loaded = max(0, num_load - num_local)
        self.engine.rates.decided(STORE, num_store_loaded * self.block_size,
                                  (num_beyond - num_store_loaded) * self.block_size)
        if num_load <= num_local:
            return await self.engine_loop.call(AddRequest(request))
        admission = await self.engine_loop.call(AddRequest(replace(request, kv=StoredKv(num_load, hashes))))
        plan = admission.load
        if plan is None:
            self.m_loads.labels("skipped").inc()  # the device had them, or no room: queued to compute
            return admission
        await self._load(plan, hashes[plan.first_block : plan.first_block + len(plan.block_ids)],
                         admission.local_payloads, path)
        return admission

    def store_path(self) -> str:
        """The path this worker's store gets take now: STORE_SHM when every live shard is on this host with its
        RAM tier in shared memory, else STORE (the data plane)."""
        return STORE_SHM if self.client.all_shared_memory() else STORE

    async def _load(self, plan: LoadPlan, hashes: list[bytes], local: list[bytes | None], path: str) -> None:
        """Get the plan's blocks not in `local` (payloads read from the host tier) from the store; import all.
        A completed load is a sample of `path`'s rate (the store's bytes over the whole load's seconds)."""
        started = time.perf_counter()
        missing = [h for h, payload in zip(hashes, local, strict=True) if payload is None]
        pool = self._staging_pool()

        def import_into(first: int, rows, device: DeviceRows | None = None) -> Awaitable[tuple[bool, object]]:
            return self.engine_loop.call(ImportChunk(plan, first, rows, pool, device))

        def to_device(chunk: StagingChunk, positions: Sequence[int]) -> ChunkSlotCopies:
            return ChunkSlotCopies(self.engine_loop, pool, chunk, positions)

        try:
            imported = await asyncio.wait_for(
                load_staged(self.client, self.layout_id, hashes, local, pool, import_into,
                            to_device if self.client.shared_memory.registrar is not None else None),
                self.settings.kv_store_load_timeout_s)
        except Exception as exc:  # down, slow, evicted meanwhile, a bad checksum: recompute
            self._count_leased_reads()
            self.m_loads.labels("timeout" if isinstance(exc, TimeoutError) else "failed").inc()
            log.warning("store load of %d blocks for %s failed (%r): recomputing", len(hashes), plan.request_id, exc)
            await self.engine_loop.call(FailLoad(plan.request_id))
            return
        self._count_leased_reads()
        self._remember(missing)  # held by the store: once cached here, not written behind again
        num_host = len(hashes) - len(missing)
        loaded = imported and await self.engine_loop.call(CompleteLoad(plan, num_host))
        if not loaded:  # aborted meanwhile, or payloads that did not fit: recomputed (if still there)
            await self.engine_loop.call(FailLoad(plan.request_id))
        self.m_loads.labels("loaded" if loaded else "failed").inc()
        if loaded:
            seconds = time.perf_counter() - started
            self.m_load_s.observe(seconds)
            self.engine.rates.observe_load(path, len(missing) * pool.block_nbytes, seconds)
            self.m_loaded_blocks.inc(len(missing))
            self.m_loaded_bytes.inc(len(missing) * pool.block_nbytes)

    def _count_leased_reads(self) -> None:
        """Bring the shared-memory and transfer-engine counters up to the client's totals (loads may overlap:
        deltas, not values)."""
        reads = self.client.shared_memory
        blocks, fallbacks, device_blocks = self._shm_counted
        self.m_shm_blocks.inc(reads.num_blocks - blocks)
        self.m_shm_fallbacks.inc(reads.num_fallbacks - fallbacks)
        self.m_shm_device_blocks.inc(reads.num_device_blocks - device_blocks)
        self._shm_counted = (reads.num_blocks, reads.num_fallbacks, reads.num_device_blocks)
        remote = self.client.transfer_engine
        blocks, fallbacks = self._te_counted
        self.m_te_blocks.inc(remote.num_blocks - blocks)
        self.m_te_fallbacks.inc(remote.num_fallbacks - fallbacks)
        self._te_counted = (remote.num_blocks, remote.num_fallbacks)

    def _staging_pool(self) -> StagingPool:
        """The loads' staging (allocated by start(); here for a tier never started)."""
        if self._staging is None:
            self._staging = self.engine.staging_pool()
        return self._staging

    # -- write-behind -------------------------------------------------------------------------------------------
    def on_kv_events(self, events: Sequence[KvCacheEvent]) -> None:
        """A step's KV events (event loop): the blocks that became writable behind. With the host tier, those its
        offload stored (written behind from their pinned slots, never gathered from the device); without it,
        those that entered the device prefix cache."""
        tier = HOST_TIER if self.engine.has_host_tier else DEVICE_TIER
        hashes = [h for event in events if isinstance(event, Stored) and event.tier == tier for h in event.block_hashes]
        if hashes:
            self.on_stored(hashes)

    def on_stored(self, block_hashes: Sequence[bytes]) -> None:
        """Blocks that just became writable behind (event loop; never blocks)."""
        if not self.client.has_shards():
            return
        limit, any_block = self.settings.kv_store_write_queue_blocks, self.settings.kv_store_write_generated
        for block_hash in block_hashes:
            if block_hash in self._known or not (any_block or block_hash in self._prompt_blocks):
                continue
            if len(self._queue) >= limit:
                self.m_dropped.labels("queue_full").inc()
                continue
            self._queue.append(block_hash)
        self.m_queue.set(len(self._queue))
        if self._queue:
            self._wake.set()

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                size = self.settings.kv_store_write_batch_blocks
                batch = [self._queue.popleft() for _ in range(min(size, len(self._queue)))]
                self.m_queue.set(len(self._queue))
                self._writing = True
                try:
                    await self._write(batch)
                except Exception as exc:
                    self.m_dropped.labels("error").inc(len(batch))
                    log.warning("write-behind of %d blocks failed: %r", len(batch), exc)
                finally:
                    self._writing = False

    async def _write(self, hashes: list[bytes]) -> None:
        present = await asyncio.wait_for(self.client.has(self.layout_id, hashes),
                                         self.settings.kv_store_lookup_timeout_s)
        self._remember([h for h, held in zip(hashes, present, strict=True) if held])
        missing = [h for h, held in zip(hashes, present, strict=True) if not held]
        if not missing:
            return
        cached = await self.engine_loop.call(PinCached(missing))
        kept = cached.block_hashes
        if len(kept) < len(missing):
            self.m_dropped.labels("evicted").inc(len(missing) - len(kept))
        if not kept:
            return
        try:
            num_bytes = sum(memoryview(p).nbytes for p in cached.payloads)
            started = time.perf_counter()
            await self.client.put(self.layout_id, kept, cached.payloads)
        finally:  # sent, failed or cancelled: the engine thread unpins the host slots at its next step
            cached.release()
        self.m_write_s.observe(time.perf_counter() - started)
        self.m_written_blocks.inc(len(kept))
        self.m_written_bytes.inc(num_bytes)
        self._remember(kept)

    def _remember(self, hashes: Sequence[bytes], known: OrderedDict[bytes, None] | None = None) -> None:
        """Add to a bounded set of hashes (default: those the store holds)."""
        known = self._known if known is None else known
        for block_hash in hashes:
            known[block_hash] = None
            known.move_to_end(block_hash)
        while len(known) > KNOWN_HASHES:
            known.popitem(last=False)


async def start_store_client(settings: WorkerSettings, bus: MessageBus) -> KvStoreClient:
    """A client following the shards' heartbeats from now on (a worker starts it before loading its model, so it
    knows the shards by the time it serves)."""
    secret = settings.common.data_plane_secret
    client = KvStoreClient(secret.get_secret_value() if secret else None, settings.kv_store_load_timeout_s,
                           settings.kv_store_shard_lease_s, transport=KvTransport(settings.kv_transport),
                           transfer_engine_host=settings.data_plane_host)
    await client.start(bus)
    return client


async def load_staged(
    client: KvStoreClient, layout_id: str, hashes: Sequence[bytes], local: Sequence[bytes | None],
    pool: StagingPool, import_chunk: Callable[..., Awaitable[tuple[bool, object]]],
    to_device: Callable[[StagingChunk, Sequence[int]], ChunkSlotCopies] | None = None,
) -> bool:
    """Load blocks chunk by chunk through the pool: blocks in `local` (host-tier payloads) are copied into the
    chunk's rows, the others received into them (client.get, every checksum verified), then
    `import_chunk(first, rows)` (the engine thread: (imported, done event)) runs while the next chunk arrives.
    With `to_device` (CUDA, a registrar on the client: `to_device(chunk, rows)` the chunk's SlotDestination),
    blocks of same-host shared-memory shards go straight to the chunk's device rows instead, and the import is
    `import_chunk(first, rows, device_rows)`; the chunks' gets then overlap too (as many as the pool lends: one
    chunk's lease and checks while another's DMA runs; the copies queue on one stream).
    False when a chunk was not imported (the request left the loading state): stop, nothing more is written.
    Raises what client.get raises; every import already issued is waited for first (its chunk goes back to the
    pool only once its rows are read), so nothing writes the blocks after this returns."""
    imports: list[asyncio.Task[bool]] = []

    async def run_import(chunk, first: int, num_rows: int, device: DeviceRows | None) -> bool:
        done = None
        try:
            if device is None:
                imported, done = await import_chunk(first, chunk.rows[:num_rows])
            else:
                imported, done = await import_chunk(first, chunk.rows[:num_rows], device)
            return imported
        finally:
            pool.release(chunk, done)

    async def receive_and_import(chunk, first: int, num_rows: int) -> bool:
        try:
            device = await _receive_chunk(client, layout_id, hashes[first : first + num_rows],
                                          local[first : first + num_rows], chunk, num_rows, to_device)
        except BaseException:
            pool.release(chunk)
            raise  # a get's error: raised once every chunk in flight is done
        try:
            return await run_import(chunk, first, num_rows, device)
        except Exception:
            return False  # an import that failed, as below: the load is not complete

    try:
        for first in range(0, len(hashes), pool.chunk_blocks):
            num_rows = min(pool.chunk_blocks, len(hashes) - first)
            chunk = await pool.acquire()
            if any(t.done() and (t.exception() is not None or not t.result()) for t in imports):
                pool.release(chunk)  # an import refused (the request left) or failed, or a get failed: stop
                break
            if to_device is not None:
                imports.append(asyncio.create_task(receive_and_import(chunk, first, num_rows)))
                continue
            try:
                device = await _receive_chunk(client, layout_id, hashes[first : first + num_rows],
                                              local[first : first + num_rows], chunk, num_rows, to_device)
            except BaseException:
                pool.release(chunk)
                raise
            imports.append(asyncio.create_task(run_import(chunk, first, num_rows, device)))
    finally:
        results = await asyncio.gather(*imports, return_exceptions=True)
    for result in results if to_device is not None else ():
        if isinstance(result, BaseException):  # a get's (receive_and_import turns an import's into False)
            raise result
    return len(imports) * pool.chunk_blocks >= len(hashes) and all(r is True for r in results)


async def _receive_chunk(client: KvStoreClient, layout_id: str, hashes: Sequence[bytes],
                         local: Sequence[bytes | None], chunk: StagingChunk, num_rows: int,
                         to_device: Callable[[StagingChunk, Sequence[int]], ChunkSlotCopies] | None,
                         ) -> DeviceRows | None:
    """Fill one chunk's rows: host-tier payloads copied, the rest received from the store (with `to_device`,
    those of same-host shared-memory shards copied to the chunk's device rows: then what the import needs)."""
    views = chunk.views[:num_rows]
    fetch = [i for i, payload in enumerate(local) if payload is None]
    for i, payload in enumerate(local):
        if payload is not None:
            if memoryview(payload).nbytes != views[i].nbytes:
                raise ValueError(f"host payload of {memoryview(payload).nbytes} bytes, rows of {views[i].nbytes}")
            views[i][:] = memoryview(payload).cast("B")
    if not fetch:
        return None
    device = None if to_device is None else to_device(chunk, fetch)
    await client.get(layout_id, [hashes[i] for i in fetch], into=[views[i] for i in fetch], device=device)
    return None if device is None else device.device_rows(num_rows)


def cached_tokens_by_tier(output: EngineOutput) -> dict[str, int]:
    """Where a request's cached prompt tokens came from: {"device": ..., "host": ..., "store": ...}."""
    return {"device": output.num_cached_tokens - output.num_store_cached_tokens - output.num_host_cached_tokens,
            "host": output.num_host_cached_tokens, "store": output.num_store_cached_tokens}
