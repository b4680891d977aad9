"""The worker's host-memory KV tier: write-through offload of cached blocks, loads on a prefix hit.

    step N computes blocks ─ they enter the device prefix cache ─► offload (after update(N)):
        copy stream waits an event of the compute stream; one gather of every layer (ops.gather_blocks, one
        launch) into a device staging buffer, then non_blocking copies into the pinned host slots; an event;
        each device block holds an extra reference until that event completed (polled at the start of a step),
        so it is never freed or reused before its copy is done, and no step waits for a copy.
    admission (EngineCore.add_request): device hits, then the following blocks held here, as many as loading beats
        recomputing at the measured rates (deepinfer.kv_costs; the rest recomputed) ─► add_loading_request
        (WAITING_FOR_REMOTE_KVS: the others keep running) ─► copy stream: pinned slots → device staging →
        one scatter of every layer (ops.scatter_blocks, one launch) ─► event ─► at the start of a later step
        finish_loading(loaded=True): the request runs from its first token not loaded. A copy that cannot be
        issued → finish_loading(loaded=False): recomputed, never garbage.
    resume (Scheduler.resume_loader): a preempted request at the head of the waiting queue, in a step that admits,
        takes the same path (its full blocks, output tokens included, were written through when computed).

Write-through and not a copy at eviction: a block is evicted when the step being scheduled needs it, so a copy
then would sit on that step's critical path (vLLM's CPU offloading also stores at compute time).

A host slot is one block in export_blocks' payload format (layer-major), so a slot is also a ready store payload:
write-behind pins the slots it writes (`pin_views`, engine thread, no copy) and sends their read-only views from
the event loop; `release` (any thread) queues the unpin, done by the engine thread at its next step.
On the CPU (the tier forced on by an explicit kv_host_cache_bytes, for tests) copies run synchronously but a load
goes through the same loading state. All methods run on the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from deepinfer.engine.block_pool import BlockPool, KVCacheBlock, KvCacheEvent
from deepinfer.engine.host_pool import HostPool
from deepinfer.engine.kv_transfer import block_nbytes
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kernels import KernelOps, compile_watch, get_ops
from deepinfer.kernels.torch_block_copy import layer_table
from deepinfer.kv_costs import DEVICE, HOST
from deepinfer.kv_rates import MeasuredRates

log = logging.getLogger(__name__)

#: Device staging buffer of the copy stream (blocks per gather / scatter round).
STAGING_BYTES = 64 << 20
#: On CUDA an offload waits for this many newly cached blocks, or OFFLOAD_MAX_STEPS steps, or the engine going
#: idle, whichever comes first: its launches (an index upload, a gather of every layer, a copy per run of slots,
#: an event) are paid once per batch, not at every step that completes a block (the engine thread's time, in series
#: with the device at small steps). A block waiting is not held: one evicted meanwhile is not offloaded.
OFFLOAD_BATCH_BLOCKS = 32
OFFLOAD_MAX_STEPS = 8


@dataclass
class HostTierStats:
    """Counters since start (read by the worker's metrics from another thread: plain ints)."""

    hit_blocks: int = 0
    miss_blocks: int = 0
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    failed_loads: int = 0
    #: Seconds of each completed load (issue → seen complete), drained by the worker's histogram.
    load_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    #: Seconds from issuing an offload to seeing its copy complete, until the metrics take them.
    offload_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=4096))


class HostTierReport(NamedTuple):
    """The host tier's running totals, occupancy, and the latency samples since the last report."""

    hit_blocks: int
    miss_blocks: int
    offloaded_blocks: int
    offloaded_bytes: int
    loaded_blocks: int
    loaded_bytes: int
    failed_loads: int
    evictions: int
    skipped_offloads: int
    used_bytes: int
    capacity_bytes: int
    load_seconds: list[float]
    offload_seconds: list[float]
    #: Seconds since each loaded block's previous use.
    hit_ages: list[float]


@dataclass
class _Copy:
    """A copy in flight: done when its event completed (None: it ran synchronously)."""

    event: torch.cuda.Event | None
    slots: list[int]
    #: Device blocks holding an extra reference until the copy is done.
    blocks: list[KVCacheBlock]
    started_s: float
    #: The copy's own time, for the tier's measured rate: on CUDA between `started` and `event` (timing events on
    #: the copy stream, so neither a step nor the wait for one counts), on the CPU the synchronous copy's seconds.
    started: torch.cuda.Event | None = None
    copy_s: float = 0.0


class HostTier:
    """Pinned host slots for one engine's KV caches, the copy stream and the copies in flight."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], num_slots: int, block_pool: BlockPool,
                 ops: KernelOps | None = None, rates: MeasuredRates | None = None) -> None:
        self.kv_caches = list(kv_caches)
        self.block_nbytes = block_nbytes(kv_caches)
        self.pool = HostPool(num_slots, block_pool.enable_kv_events)
        self.block_pool = block_pool
        self.device = kv_caches[0].device
        self.cuda = self.device.type == "cuda"
        #: The engine's measured rates: each load is a sample of this tier's, and admission decides from them.
        self.rates = rates if rates is not None else MeasuredRates.for_device(self.device.type)
        #: gather_blocks / scatter_blocks: the one-launch Triton kernels on CUDA (the torch twins without Triton).
        self.ops = ops if ops is not None else get_ops("cuda" if self.cuda else "cpu")
        self._layers = layer_table(self.kv_caches)
        self.host = torch.empty((num_slots, self.block_nbytes), dtype=torch.uint8, pin_memory=self.cuda)
        #: The pinned pool's bytes, read-only: write-behind's views of pinned slots (no copy).
        self._host_bytes = memoryview(self.host.numpy().reshape(-1)).toreadonly()
        #: Slot lists write-behind is done reading (appended by any thread; unpinned on the engine thread).
        self._released: deque[list[int]] = deque()
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            chunk = max(1, min(num_slots, STAGING_BYTES // self.block_nbytes))
            self._staging = torch.empty((chunk, self.block_nbytes), dtype=torch.uint8, device=self.device)
            with compile_watch.install().starting():  # the kernels compile now, not in a step's offload
                self._warm_up()
        self._offloads: deque[_Copy] = deque()
        self._loads: dict[str, _Copy] = {}
        #: Newly cached blocks not offloaded yet, and the steps they have waited (CPU: offloaded at once).
        self._pending: list[tuple[KVCacheBlock, bytes]] = []
        self._pending_steps = 0
        self.offload_batch_blocks, self.offload_max_steps = (OFFLOAD_BATCH_BLOCKS, OFFLOAD_MAX_STEPS) if self.cuda \
            else (1, 1)
        self.stats = HostTierStats()
        block_pool.track_cached = True

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the pinned pool."""
        return self.pool.num_slots * self.block_nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes of slots holding a block or being written."""
        return self.pool.num_used * self.block_nbytes

    def report(self) -> HostTierReport:
        """Totals and occupancy now, and the samples taken since the last report (drained: any thread may call,
        the engine thread only appends)."""
        stats, pool = self.stats, self.pool
        return HostTierReport(
            stats.hit_blocks, stats.miss_blocks, stats.offloaded_blocks, stats.offloaded_bytes, stats.loaded_blocks,
            stats.loaded_bytes, stats.failed_loads, pool.num_evictions, pool.num_skipped, self.used_bytes,
            self.capacity_bytes, _drain(stats.load_seconds), _drain(stats.offload_seconds), _drain(pool.hit_ages))

    @property
    def busy(self) -> bool:
        """True while a copy is in flight (the engine keeps polling)."""
        return bool(self._loads or self._offloads)

    def close(self) -> None:
        """Wait for the copies in flight and let the pool go: its pinned memory is freed now, or when the last
        write-behind view of a slot is dropped (a view keeps its buffer alive). The tier is unusable after."""
        if self.cuda:
            self.stream.synchronize()
            self._staging = None
        self._offloads.clear()
        self._loads.clear()
        self._pending.clear()
        self.host = self._host_bytes = None

    def holds_device_block(self, block_id: int) -> bool:
        """True while an offload copies from this device block (tests: never reused meanwhile)."""
        return any(block.block_id == block_id for copy in self._offloads for block in copy.blocks)

    # -- loads --------------------------------------------------------------------------------------------------
    def start_load(self, scheduler: Scheduler, request: Request) -> bool:
        """Admit a new request (or resume a preempted one) whose prefix past the device hits is held here: loading
        state, copy issued. False: nothing to load or no room (nothing changed; queue a new one with add_request)."""
        block_size = scheduler.config.block_size
        request.bind_block_hashing(block_size, scheduler.config.model_fingerprint)
        if not scheduler.block_pool.enable_caching or request.needs_prompt_logits:
            return False
        hashes = request.block_hashes[: (request.num_tokens - 1) // block_size]
        _, num_device_tokens = scheduler.kv_manager.get_computed_blocks(request)
        num_device = num_device_tokens // block_size
        num_held = self.pool.num_leading_hits(hashes[num_device:])
        num_misses = len(hashes) - num_device - num_held
        num_host = self.blocks_worth_loading(num_device, num_held, block_size)
        # A resume is looked up at every step that admits until it is admitted: its misses count once, as it loads.
        if request.num_preemptions == 0:
            self.stats.miss_blocks += num_misses
            self.rates.decided(HOST, num_host * block_size, (num_held - num_host) * block_size)
        if num_host == 0:
            return False
        plan = scheduler.add_loading_request(request, num_device + num_host)
        if plan is None:
            return False
        if request.num_preemptions:
            self.stats.miss_blocks += num_misses
        first_block, block_ids = plan
        slots = self.pool.pin(hashes[first_block : first_block + len(block_ids)])
        blocks = [self.block_pool.blocks[i] for i in block_ids]
        self.block_pool.touch(blocks)  # an abort meanwhile must not hand them out while the copy writes them
        self.stats.hit_blocks += len(block_ids)
        copy = _Copy(None, slots, blocks, time.perf_counter())
        copy.started = torch.cuda.Event(enable_timing=True) if self.cuda else None
        try:
            copy.event = self.copy_to_device(slots, block_ids, copy.started)
            copy.copy_s = time.perf_counter() - copy.started_s
        except Exception:
            log.exception("host-tier load of %d blocks for %s failed: recomputing", len(slots), request.request_id)
            self._end_load(scheduler, request.request_id, copy, loaded=False)
            return True
        self._loads[request.request_id] = copy
        return True

    def blocks_worth_loading(self, num_device: int, num_held: int, block_size: int) -> int:
        """How many of the `num_held` blocks held here past `num_device` device hits to load: those whose load
        beats recomputing them at the measured rates (deepinfer.kv_costs), the others recomputed."""
        costs = self.rates.costs(block_size, self.block_nbytes, host=True, store_path=None)
        return max(0, costs.blocks_to_load([(DEVICE, num_device), (HOST, num_held)]) - num_device)

    def poll(self, scheduler: Scheduler) -> None:
        """At the start of a step: finish the copies that completed (never waits for one); unpin what write-behind
        released."""
        self.unpin_released()
        if self._offloads:
            self._finish_offloads()
        for request_id, copy in list(self._loads.items()) if self._loads else ():
            if copy.event is None or copy.event.query():
                del self._loads[request_id]
                self._end_load(scheduler, request_id, copy, loaded=True)

    def _end_load(self, scheduler: Scheduler, request_id: str, copy: _Copy, loaded: bool) -> None:
        scheduler.finish_loading(request_id, loaded=loaded, num_host_blocks=len(copy.blocks))
        self.pool.unpin(copy.slots)
        self.block_pool.free_blocks(reversed(copy.blocks))
        if loaded:
            seconds = time.perf_counter() - copy.started_s
            self.stats.loaded_blocks += len(copy.slots)
            self.stats.loaded_bytes += len(copy.slots) * self.block_nbytes
            self.stats.load_seconds.append(seconds)
            copy_s = copy.started.elapsed_time(copy.event) / 1e3 if copy.started is not None else copy.copy_s
            self.rates.observe_load(HOST, len(copy.slots) * self.block_nbytes, copy_s)
        else:
            self.stats.failed_loads += 1

    # -- offloads -----------------------------------------------------------------------------------------------
    def offload(self, flush: bool = False) -> None:
        """After a step: copy the blocks that entered the device prefix cache (and are not held here) to host,
        in batches (OFFLOAD_BATCH_BLOCKS, OFFLOAD_MAX_STEPS); `flush`: now (the engine has nothing left to run)."""
        newly_cached = self.block_pool.newly_cached
        if newly_cached:
            self._pending += newly_cached
            self.block_pool.newly_cached = []
        elif not self._pending:
            return  # the usual decode step: nothing cached, nothing waiting
        self._pending_steps += 1
        if not flush and len(self._pending) < self.offload_batch_blocks and \
                self._pending_steps < self.offload_max_steps:
            return
        newly_cached, self._pending, self._pending_steps = self._pending, [], 0
        blocks, slots = [], []
        for i, (block, block_hash) in enumerate(newly_cached):
            if block.block_hash != block_hash or block_hash in self.pool:
                continue
            slot = self.pool.reserve(block_hash)
            if slot is None:  # every slot pinned: the rest are skipped too (counted without a scan each)
                self.pool.num_skipped += len(newly_cached) - i - 1
                break
            blocks.append(block)
            slots.append(slot)
        if not blocks:
            return
        self.block_pool.touch(blocks)
        try:
            event = self.copy_to_host([b.block_id for b in blocks], slots)
        except Exception:
            log.exception("host-tier offload of %d blocks failed", len(blocks))
            self.pool.abort(slots)
            self.block_pool.free_blocks(reversed(blocks))
            return
        self._offloads.append(_Copy(event, slots, blocks, time.perf_counter()))
        self.stats.offloaded_blocks += len(blocks)
        self.stats.offloaded_bytes += len(blocks) * self.block_nbytes
        if event is None:
            self._finish_offloads()

    def _finish_offloads(self) -> None:
        """Offloads run in order on one stream: finish those done, from the oldest."""
        while self._offloads and (self._offloads[0].event is None or self._offloads[0].event.query()):
            copy = self._offloads.popleft()
            self.pool.commit(copy.slots)
            self.stats.offload_seconds.append(time.perf_counter() - copy.started_s)
            self.block_pool.free_blocks(reversed(copy.blocks))

    def take_events(self) -> list[KvCacheEvent]:
        """Host-tier Stored / Removed since the last call."""
        return self.pool.take_events()

    def payloads(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """Each block's payload (export_blocks' format) if held here, else None: copies, safe to keep."""
        out: list[bytes | None] = []
        for block_hash in block_hashes:
            slot = self.pool.lookup(block_hash)
            out.append(None if slot is None else self.host[slot].numpy().tobytes())
        return out

    def pin_views(self, block_hashes: Sequence[bytes]) -> tuple[list[int | None], list[memoryview | None]]:
        """(slot, read-only view of its bytes) of each block held here, None for the others: pinned, so neither
        evicted nor rewritten until `release(slots)`; the views are payloads (export_blocks' format), uncopied,
        readable from any thread meanwhile. O(1) per block: a lookup, a pin, a slice."""
        self.unpin_released()
        slots, size, data = self.pool.pin_held(block_hashes), self.block_nbytes, self._host_bytes
        return slots, [None if slot is None else data[slot * size : (slot + 1) * size] for slot in slots]

    def release(self, slots: Sequence[int]) -> None:
        """Any thread: done with the views of these pinned slots (unpinned at the engine thread's next step)."""
        if slots:
            self._released.append(list(slots))  # deque.append / popleft are atomic: no lock

    def unpin_released(self) -> None:
        """Engine thread: unpin the slots released since the last call."""
        while self._released:
            self.pool.unpin(self._released.popleft())

    # -- copies -------------------------------------------------------------------------------------------------
    def copy_to_host(self, block_ids: list[int], slots: list[int]) -> torch.cuda.Event | None:
        """Device blocks → host slots: per staging chunk one gather of every layer, then one copy per slot run."""
        if not self.cuda:
            rows = torch.empty((len(block_ids), self.block_nbytes), dtype=torch.uint8)
            self.ops.gather_blocks(self.kv_caches, torch.tensor(block_ids, dtype=torch.long), rows, self._layers)
            self.host.index_copy_(0, torch.tensor(slots, dtype=torch.long), rows)
            return None
        with self._on_copy_stream():
            for start in range(0, len(block_ids), self._staging.shape[0]):
                ids, chunk_slots = block_ids[start : start + self._staging.shape[0]], slots[start:]
                self.ops.gather_blocks(self.kv_caches, self._device_index(ids), self._staging[: len(ids)],
                                       self._layers)
                for first, host_first, count in _runs(chunk_slots[: len(ids)]):
                    self.host[host_first : host_first + count].copy_(self._staging[first : first + count],
                                                                     non_blocking=True)
            return self._record()

    def copy_to_device(self, slots: list[int], block_ids: list[int],
                       started: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """Host slots → device blocks: per staging chunk one copy per slot run, then one scatter of every layer.
        `started` (a timing event): recorded on the copy stream as the copy begins, the returned event then times
        the copy too."""
        if not self.cuda:
            rows = self.host.index_select(0, torch.tensor(slots, dtype=torch.long))
            self.ops.scatter_blocks(rows, self.kv_caches, torch.tensor(block_ids, dtype=torch.long), self._layers)
            return None
        with self._on_copy_stream():
            if started is not None:
                started.record(self.stream)
            for start in range(0, len(block_ids), self._staging.shape[0]):
                ids, chunk_slots = block_ids[start : start + self._staging.shape[0]], slots[start:]
                for first, host_first, count in _runs(chunk_slots[: len(ids)]):
                    self._staging[first : first + count].copy_(self.host[host_first : host_first + count],
                                                               non_blocking=True)
                self.ops.scatter_blocks(self._staging[: len(ids)], self.kv_caches, self._device_index(ids),
                                        self._layers)
            return self._record(timing=started is not None)

    def _warm_up(self) -> None:
        """Compile the block copies at start: block 0 (the padding block) to the staging and back, unchanged."""
        with self._on_copy_stream():
            padding = self._device_index([0])
            self.ops.gather_blocks(self.kv_caches, padding, self._staging[:1], self._layers)
            self.ops.scatter_blocks(self._staging[:1], self.kv_caches, padding, self._layers)
        self.stream.synchronize()

    def _on_copy_stream(self) -> torch.cuda.StreamContext:
        """Enter the copy stream, after everything the compute stream has been given so far (the step that
        computed the blocks; for a load, any step still touching blocks freed since)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def _device_index(self, ids: list[int]) -> torch.Tensor:
        # From pinned memory, non_blocking: a pageable copy would make the engine thread wait for the stream.
        return torch.tensor(ids, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)

    def _record(self, timing: bool = False) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self.stream)
        return event


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position, first slot, count) of each run of consecutive slots: one host copy per run."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            position, first, count = runs[-1]
            runs[-1] = (position, first, count + 1)
        else:
            runs.append((i, slot, 1))
    return runs


def _drain(samples: deque[float]) -> list[float]:
    """Take every sample in arrival order (popleft: safe beside the engine thread's appends)."""
    taken = []
    while samples:
        taken.append(samples.popleft())
    return taken
