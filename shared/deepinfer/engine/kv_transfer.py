"""KV block export/import: paged KV caches ⇄ one bytes payload per block, for the data plane and the store.

Cache per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 = K, 1 = V); block 0 is the
reserved padding block and is never exported or imported.

Payload of one block (layer-major), raw little-endian bytes of the cache dtype (bf16 as its 2-byte words):

    layer 0: K [block_size, num_kv_heads, head_dim] ‖ V [block_size, num_kv_heads, head_dim]
    layer 1: K ‖ V
    ...
    size = num_layers · 2 · block_size · num_kv_heads · head_dim · itemsize  (= block_nbytes)

i.e. a C-order [num_layers, 2, block_size, num_kv_heads, head_dim] array.

A store load lands its payloads in a StagingPool's rows (reused; pinned on CUDA, so no per-load cudaHostAlloc and
no memcpy after the receive) and `import_rows` moves a chunk of rows into its blocks: one host→device copy and
one scatter_blocks of every layer (one launch on CUDA), so the engine thread's work per load is O(chunks).

Latent (MLA) caches are [num_blocks, block_size, latent_dim] per layer; a block's payload is then the C-order
[num_layers, block_size, latent_dim] array (KvLayout.latent_dim set, kv_layout "latent").
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.dataplane.buffers import prefault
from deepinfer.dataplane.frames import BytesLike
from deepinfer.dataplane.layout import LayoutMismatch, check_layout
from deepinfer.kernels import KernelOps, torch_block_copy
from deepinfer.kernels.torch_block_copy import LayerTable
from deepinfer.protocol.kv import KvLayout

__all__ = [
    "DeviceRows",
    "LayoutMismatch",
    "StagingChunk",
    "StagingPool",
    "block_nbytes",
    "check_layout",
    "export_blocks",
    "import_blocks",
    "import_device_rows",
    "import_rows",
    "kv_layout_of",
]


def _is_latent(kv: torch.Tensor) -> bool:
    return kv.dim() == 3


def _block_dim(kv: torch.Tensor) -> int:
    """The block axis: 1 in [2, num_blocks, ...] caches, 0 in latent [num_blocks, block_size, latent_dim]."""
    return 0 if _is_latent(kv) else 1


def _check_caches(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every layer has the same 5-d (K/V) or 3-d (latent) shape, dtype and device; returns the first layer."""
    if not kv_caches:
        raise ValueError("kv_caches is empty")
    first = kv_caches[0]
    for layer, kv in enumerate(kv_caches):
        if not _is_latent(kv) and (kv.dim() != 5 or kv.shape[0] != 2):
            raise ValueError(
                f"layer {layer}: kv cache must be [2, num_blocks, block_size, num_kv_heads, head_dim] or "
                f"[num_blocks, block_size, latent_dim], got {tuple(kv.shape)}"
            )
        if kv.shape != first.shape or kv.dtype != first.dtype or kv.device != first.device:
            raise ValueError(
                f"layer {layer}: {tuple(kv.shape)} {kv.dtype} on {kv.device} differs from layer 0's "
                f"{tuple(first.shape)} {first.dtype} on {first.device}"
            )
    if sys.byteorder != "little":
        raise NotImplementedError("KV payloads are little-endian; big-endian hosts are not supported")
    return first


def _check_block_ids(first: torch.Tensor, block_ids: Sequence[int], *, unique: bool) -> list[int]:
    """The ids as ints; ValueError for one outside the cache (or the padding block 0), or a repeat when `unique`."""
    num_blocks = first.shape[_block_dim(first)]
    for block_id in block_ids:
        if not 1 <= int(block_id) < num_blocks:
            raise ValueError(f"block id {block_id} outside [1, {num_blocks}) (block 0 is the padding block)")
    if unique and len(set(block_ids)) != len(block_ids):
        raise ValueError(f"duplicate block ids in {list(block_ids)}")
    return [int(b) for b in block_ids]


def _block_index(first: torch.Tensor, block_ids: Sequence[int], *, unique: bool) -> torch.Tensor:
    return torch.tensor(_check_block_ids(first, block_ids, unique=unique), dtype=torch.long, device=first.device)


def block_nbytes(kv_caches: Sequence[torch.Tensor]) -> int:
    """Bytes of one block's payload: K and V of every layer."""
    first = _check_caches(kv_caches)
    per_block = first.numel() // first.shape[_block_dim(first)]
    return len(kv_caches) * per_block * first.element_size()


def kv_layout_of(
    kv_caches: Sequence[torch.Tensor], block_size: int | None = None, dtype_name: str | None = None
) -> KvLayout:
    """The KvLayout of these caches (for a worker's KvHandle); block_size / dtype_name, if given, must agree."""
    first = _check_caches(kv_caches)
    if _is_latent(first):
        cache_block_size, num_kv_heads, head_dim, latent_dim = first.shape[1], 0, 0, first.shape[2]
    else:
        (_, _, cache_block_size, num_kv_heads, head_dim), latent_dim = first.shape, None
    cache_dtype = str(first.dtype).removeprefix("torch.")
    if block_size is not None and block_size != cache_block_size:
        raise ValueError(f"block_size={block_size} but the caches hold blocks of {cache_block_size} tokens")
    if dtype_name is not None and dtype_name.removeprefix("torch.") != cache_dtype:
        raise ValueError(f"dtype_name={dtype_name!r} but the caches are {cache_dtype}")
    return KvLayout(
        dtype=cache_dtype,
        block_size=cache_block_size,
        num_layers=len(kv_caches),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        kv_layout="nhd" if latent_dim is None else "latent",
        latent_dim=latent_dim,
    )


def export_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[bytes]:
    """One payload per block id, in order: one index_select per layer, one device→host copy in all."""
    first = _check_caches(kv_caches)
    if not block_ids:
        return []
    index = _block_index(first, block_ids, unique=False)
    num_blocks = len(block_ids)
    # Each block's bytes contiguous, layer-major (the torch twin of the block copies: one gather per layer).
    gathered = torch.empty((num_blocks, block_nbytes(kv_caches)), dtype=torch.uint8, device=first.device)
    torch_block_copy.gather_blocks(kv_caches, index, gathered)
    # Through pinned memory on an accelerator: a pageable device→host copy runs at a fraction of PCIe speed.
    host = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=first.device.type == "cuda")
    host.copy_(gathered)
    flat = host.numpy()
    return [flat[i].tobytes() for i in range(num_blocks)]


def import_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], payloads: Sequence[BytesLike]
) -> None:
    """Write payloads (export_blocks' format) into these block ids: one host→device copy, one scatter per layer."""
    first = _check_caches(kv_caches)
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} block ids but {len(payloads)} payloads")
    if not block_ids:
        return
    index = _block_index(first, block_ids, unique=True)
    nbytes = block_nbytes(kv_caches)
    for i, payload in enumerate(payloads):
        size = memoryview(payload).nbytes
        if size != nbytes:
            raise ValueError(
                f"payload for block id {block_ids[i]} (#{i}) is {size} bytes; the layout needs {nbytes}"
            )
    num_blocks = len(block_ids)
    # Staging buffer in pinned memory when the cache is on an accelerator: an async, full-speed upload.
    pin = first.device.type == "cuda"
    staging = torch.empty((num_blocks, nbytes), dtype=torch.uint8, pin_memory=pin)
    staging_np = staging.numpy()
    for i, payload in enumerate(payloads):
        staging_np[i] = np.frombuffer(payload, dtype=np.uint8)
    torch_block_copy.scatter_blocks(staging.to(first.device, non_blocking=pin), kv_caches, index)


def import_rows(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], rows: torch.Tensor, ops: KernelOps,
    table: LayerTable | None = None,
) -> torch.cuda.Event | None:
    """Write rows [n, block nbytes] (uint8 on the host, export_blocks' format; pinned on CUDA) into these block
    ids: one host→device copy and one ops.scatter_blocks of every layer, on the current stream (so the steps after
    it see the blocks). On CUDA the event after which the rows may be reused (None: done already). ValueError for
    a wrong shape or block id."""
    first = _check_caches(kv_caches)
    nbytes = block_nbytes(kv_caches)
    if rows.dtype != torch.uint8 or tuple(rows.shape) != (len(block_ids), nbytes):
        raise ValueError(f"rows must be [{len(block_ids)}, {nbytes}] uint8, got {tuple(rows.shape)} {rows.dtype}")
    if not block_ids:
        return None
    cuda = first.device.type == "cuda"
    ids = torch.tensor(_check_block_ids(first, block_ids, unique=True), dtype=torch.long)
    if not cuda:
        ops.scatter_blocks(rows, kv_caches, ids, table)
        return None
    # Both copies from pinned memory, non_blocking: the engine thread only issues them.
    on_device = rows.to(first.device, non_blocking=True)
    ops.scatter_blocks(on_device, kv_caches, ids.pin_memory().to(first.device, non_blocking=True), table)
    event = torch.cuda.Event()
    event.record()
    return event


@dataclass(frozen=True)
class DeviceRows:
    """A chunk whose rows are partly on the device already: `rows` [n, block_nbytes] uint8 on the device (the
    chunk's device side), `positions` the rows copied there from shared memory (checked); the others are in the
    host rows and go up with the import."""

    rows: torch.Tensor
    positions: tuple[int, ...]


def import_device_rows(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], host_rows: torch.Tensor, device: DeviceRows,
    ops: KernelOps, table: LayerTable | None = None,
) -> torch.cuda.Event:
    """import_rows for a chunk part of which is on the device (CUDA): the host rows not in device.positions copied
    up into the device rows (one non_blocking copy per run, from pinned memory), then one ops.scatter_blocks of
    every layer from the device rows, all on the current stream; the event after which both sides may be reused."""
    first = _check_caches(kv_caches)
    nbytes, n = block_nbytes(kv_caches), len(block_ids)
    for name, rows in (("host rows", host_rows), ("device rows", device.rows)):
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (n, nbytes):
            raise ValueError(f"{name} must be [{n}, {nbytes}] uint8, got {tuple(rows.shape)} {rows.dtype}")
    if device.rows.device != first.device or any(not 0 <= p < n for p in device.positions):
        raise ValueError(f"device rows on {device.rows.device} at {device.positions} for {n} blocks on {first.device}")
    ids = torch.tensor(_check_block_ids(first, block_ids, unique=True), dtype=torch.long)
    on_device = set(device.positions)
    start = None
    for i in range(n + 1):  # runs of host rows: [start, i)
        if i < n and i not in on_device:
            start = i if start is None else start
        elif start is not None:
            device.rows[start:i].copy_(host_rows[start:i], non_blocking=True)
            start = None
    ops.scatter_blocks(device.rows, kv_caches, ids.pin_memory().to(first.device, non_blocking=True), table)
    event = torch.cuda.Event()
    event.record()
    return event


class StagingChunk:
    """chunk_blocks rows of one block each: `rows` [chunk_blocks, block nbytes] uint8, and one writable
    memoryview per row (what a get receives into)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        flat = rows.numpy()
        self.views = [memoryview(flat[i]) for i in range(rows.shape[0])]
        #: Set by the last import from these rows (CUDA): the rows are reused only once it has completed.
        self.done: torch.cuda.Event | None = None
        #: The chunk's device side (CUDA, allocated by the engine thread at the first copy of shared-memory slots
        #: straight to the device: deepinfer.engine.slot_dma); `done` covers it too.
        self.device_rows: torch.Tensor | None = None


class StagingPool:
    """Reusable staging for store loads: num_chunks chunks of chunk_blocks rows of block_nbytes, allocated once
    (pinned with `pin`: on CUDA that allocation costs ~0.1-0.5 s per GiB, paid here once instead of per load;
    elsewhere their pages are mapped now), lent one chunk at a time (event loop: `acquire` / `release`).

    A load holds at most a chunk or two, whatever its size, so one load's next chunk is received while the
    engine thread imports the previous one. `layers`: the caches' LayerTable, built by the engine thread."""

    def __init__(self, block_nbytes: int, chunk_blocks: int, num_chunks: int, pin: bool) -> None:
        if block_nbytes <= 0 or chunk_blocks <= 0 or num_chunks <= 0:
            raise ValueError("block_nbytes, chunk_blocks and num_chunks must be positive")
        self.block_nbytes, self.chunk_blocks = block_nbytes, chunk_blocks
        self._free: asyncio.Queue[StagingChunk] = asyncio.Queue()
        #: (address, length) of every chunk's rows: what a transfer engine registers once to read into them.
        self.host_ranges: list[tuple[int, int]] = []
        for _ in range(num_chunks):
            rows = torch.empty((chunk_blocks, block_nbytes), dtype=torch.uint8, pin_memory=pin)
            if not pin:
                prefault(rows.data_ptr(), rows.numel())
            self._free.put_nowait(StagingChunk(rows))
            self.host_ranges.append((rows.data_ptr(), rows.numel()))
        self.layers: LayerTable | None = None
        self._copy_stream: torch.cuda.Stream | None = None

    def device_rows(self, chunk: StagingChunk, device: torch.device) -> torch.Tensor:
        """Engine thread: the chunk's device rows [chunk_blocks, block_nbytes] (allocated at first use)."""
        if chunk.device_rows is None:
            chunk.device_rows = torch.empty(tuple(chunk.rows.shape), dtype=torch.uint8, device=device)
        return chunk.device_rows

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        """Engine thread: the stream shared-memory slots are copied to device rows on (never the compute stream:
        a step does not wait for these copies)."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        return self._copy_stream

    async def acquire(self) -> StagingChunk:
        """A free chunk (waits for one), its last import from it complete."""
        chunk = await self._free.get()
        if chunk.done is not None and not chunk.done.query():
            done = chunk.done
            try:
                await asyncio.to_thread(done.synchronize)
            except BaseException:
                self._free.put_nowait(chunk)
                raise
        chunk.done = None
        return chunk

    def release(self, chunk: StagingChunk, done: torch.cuda.Event | None = None) -> None:
        """Give a chunk back; `done`: the event after which its rows are no longer read (CUDA)."""
        chunk.done = done
        self._free.put_nowait(chunk)
