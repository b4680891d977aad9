"""The kvcache store on top of an EngineCore: requests admitted with their prefix loaded from the store, and the
export of cached blocks for write-behind. The network side lives in deepinfer.worker.store_tier.

    start_load   a new request → WAITING_FOR_REMOTE_KVS, blocks allocated for its stored prefix (or None)
    (the worker fetches the payloads; the engine keeps stepping the other requests meanwhile)
    finish_load  payloads → import into those blocks → the request runs from its first token not loaded
    (staged: import_chunk per chunk of staging rows as it arrives, each only while the request still loads,
    then complete_load; the blocks are cached only then, so a failed load never serves a partial prefix)
    fail_load    the fetch failed or timed out → the blocks are dropped unused, the prompt is recomputed
    pin_cached   write-behind: the payloads of cached blocks to put (host slots pinned, no copy) → release()

All of these touch scheduler state and KV tensors: call them on the engine thread, between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.dataplane.frames import BytesLike
from deepinfer.engine.core import EngineCore
from deepinfer.engine.host_tier import HostTier
from deepinfer.engine.kv_transfer import (
    DeviceRows,
    StagingPool,
    block_nbytes,
    export_blocks,
    import_blocks,
    import_device_rows,
    import_rows,
)
from deepinfer.engine.requests import EngineRequest, LoadPlan
from deepinfer.kernels.torch_block_copy import layer_table

log = logging.getLogger(__name__)


#: Bytes of one staging chunk of a load (a get and an import each), and chunks in the pool (two loads in flight,
#: each receiving one chunk while the engine thread imports its previous one).
LOAD_CHUNK_BYTES = 32 << 20
LOAD_CHUNKS = 4
#: On CUDA: a chunk is also one lease and one DMA of same-host shared-memory slots, whose fixed cost (a lease /
#: release round trip, two engine-thread calls) 32 MiB chunks did not amortise: `bench/kv/kv_shm.py --device cuda
#: --blocks 1024` on an H200 gave 22.8 / 36.7 / 41.4 GB/s at 16 / 64 / 128 blocks of 2 MiB a chunk, against 55 GB/s
#: for a pinned copy_ (docs/journal/kvstore-2026-12.md, "On a GPU"). 4 chunks: 512 MiB pinned, and as much device memory once a DMA runs.
LOAD_CHUNK_BYTES_CUDA = 128 << 20


def start_load(core: EngineCore, request: EngineRequest, num_stored_blocks: int) -> LoadPlan | None:
    """Admit a request whose first `num_stored_blocks` full blocks are in the store, waiting for their KV; None
    when the device already has them or there is no room: then it was queued the ordinary way (computed, or
    loaded from the host tier where that holds its prefix).
    ValueError, like add_request, for an invalid request."""
    engine_request = core.new_request(request.request_id, request.prompt_token_ids, request.sampling_params,
                                      request.cache_salt, request.output_token_ids, request.hold_blocks)
    plan = core.scheduler.add_loading_request(engine_request, num_stored_blocks)
    if plan is None:
        if core.host_tier is None or not core.host_tier.start_load(core.scheduler, engine_request):
            core.scheduler.add_request(engine_request)
        return None
    return LoadPlan(request.request_id, plan[0], plan[1])


def new_staging_pool(kv_caches: Sequence[torch.Tensor]) -> StagingPool:
    """LOAD_CHUNKS chunks of LOAD_CHUNK_BYTES (LOAD_CHUNK_BYTES_CUDA on CUDA, pinned) of these caches' blocks."""
    nbytes, cuda = block_nbytes(kv_caches), kv_caches[0].device.type == "cuda"
    chunk_bytes = LOAD_CHUNK_BYTES_CUDA if cuda else LOAD_CHUNK_BYTES
    return StagingPool(nbytes, max(1, chunk_bytes // nbytes), LOAD_CHUNKS, pin=cuda)


def finish_load(core: EngineCore, plan: LoadPlan, payloads: Sequence[bytes], num_host_blocks: int = 0) -> bool:
    """Write the loaded payloads into the plan's blocks and let the request run; False (and recompute) when the
    payloads do not fit the cache. `num_host_blocks` of them were read from the host tier (reported as host
    tokens, the rest as store tokens). A request aborted meanwhile no longer owns those blocks: nothing is written."""
    if plan.request_id not in core.scheduler.loading:
        return False
    try:
        import_blocks(core.runner.kv_caches, plan.block_ids, payloads)
    except ValueError as exc:  # wrong count or size: the blocks stay unused, never served
        log.warning("store payloads for %s do not fit (%s): recomputing", plan.request_id, exc)
        core.scheduler.finish_loading(plan.request_id, loaded=False)
        return False
    core.scheduler.finish_loading(plan.request_id, loaded=True, num_host_blocks=num_host_blocks)
    return True


def import_chunk(core: EngineCore, plan: LoadPlan, first: int, rows: torch.Tensor, pool: StagingPool,
                 device: DeviceRows | None = None) -> tuple[bool, torch.cuda.Event | None]:
    """Write rows (verified payloads, in staging) into the plan's blocks [first, first + len(rows)): one
    import_rows (O(1) launches); with `device` (CUDA: some rows were copied to the chunk's device side from
    shared memory) import_device_rows. (False, None) when the request no longer loads (aborted: its blocks may
    belong to another request now; nothing is written) or the rows do not fit; else (True, the event after which
    the rows may be reused)."""
    if plan.request_id not in core.scheduler.loading:
        return False, None
    kv_caches = core.runner.kv_caches
    if pool.layers is None:
        pool.layers = layer_table(kv_caches)
    block_ids = plan.block_ids[first : first + rows.shape[0]]
    try:
        if device is not None:
            return True, import_device_rows(kv_caches, block_ids, rows, device, core.ops, pool.layers)
        return True, import_rows(kv_caches, block_ids, rows, core.ops, pool.layers)
    except ValueError as exc:
        log.warning("store payloads for %s do not fit (%s): recomputing", plan.request_id, exc)
        return False, None


def complete_load(core: EngineCore, plan: LoadPlan, num_host_blocks: int = 0) -> bool:
    """Every chunk of the plan was imported (import_chunk): the blocks are cached and the request runs. False
    when it was aborted meanwhile."""
    if plan.request_id not in core.scheduler.loading:
        return False
    core.scheduler.finish_loading(plan.request_id, loaded=True, num_host_blocks=num_host_blocks)
    return True


def fail_load(core: EngineCore, request_id: str) -> None:
    """The load failed or timed out: the request waits to be recomputed."""
    core.scheduler.finish_loading(request_id, loaded=False)


def export_cached(core: EngineCore, block_hashes: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(hashes, payloads) of the blocks still cached, in order; evicted ones are left out. A block the host tier
    holds is read from its pinned slot (already a payload: a host memcpy, no device work); the rest are gathered
    from the device cache in one export (a device→host copy the engine thread waits for)."""
    host_payloads = core.host_tier.payloads(block_hashes) if core.host_tier is not None else [None] * len(block_hashes)
    pool = core.scheduler.block_pool
    found: list[tuple[bytes, bytes | int]] = []
    for block_hash, payload in zip(block_hashes, host_payloads, strict=True):
        if payload is not None:
            found.append((block_hash, payload))
        elif (block := pool.get_cached_block(block_hash)) is not None:
            found.append((block_hash, block.block_id))
    device_ids = [ref for _, ref in found if isinstance(ref, int)]
    exported = iter(export_blocks(core.runner.kv_caches, device_ids) if device_ids else ())
    return [h for h, _ in found], [ref if isinstance(ref, bytes) else next(exported) for _, ref in found]


@dataclass
class CachedPayloads:
    """Blocks to write behind: `payloads` are read-only views of pinned host slots (or, with no host tier, copies
    exported from the device), valid until `release()` (any thread: the engine thread unpins at its next step)."""

    block_hashes: list[bytes]
    payloads: list[BytesLike]
    slots: list[int] = field(default_factory=list)
    host_tier: HostTier | None = None

    def release(self) -> None:
        """Done reading the payloads (idempotent)."""
        if self.host_tier is not None:
            self.host_tier.release(self.slots)
        self.slots, self.payloads = [], []


def pin_cached(core: EngineCore, block_hashes: Sequence[bytes]) -> CachedPayloads:
    """The blocks still cached, in order, for write-behind; the others are left out. With the host tier: only the
    blocks it holds, each slot pinned and handed out as a view (a lookup and a pin per block: no copy, no device
    work on the engine thread); a block not (or no longer) held there is left out, never gathered from the device.
    Without it: export_cached's device export (one gather, and a device→host copy the engine thread waits for)."""
    host_tier = core.host_tier
    if host_tier is None:
        kept, payloads = export_cached(core, block_hashes)
        return CachedPayloads(kept, list(payloads))
    slots, views = host_tier.pin_views(block_hashes)
    held = [(h, slot, view) for h, slot, view in zip(block_hashes, slots, views, strict=True) if view is not None]
    return CachedPayloads([h for h, _, _ in held], [v for _, _, v in held], [s for _, s, _ in held], host_tier)
