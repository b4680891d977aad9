"""Same-host KV handoff device to device: CUDA IPC of the owner's cache, one peer copy per chunk of layers.

The prefill worker (owner) exports, once at start, a CUDA IPC description of each layer's KV cache
(`export_caches` → `KvDeviceExport`, msgpack fields only, never pickle) and puts it on every `KvHandle`. A
decode worker on the same host (same `host_id()`, the owner's GPU visible here) maps the owner's cache once
(`PeerCaches.get`) and copies the leased block ids into its own blocks (`copy_into`, from `Engine.add_request`
with a `PeerDeviceKv`): per chunk of
layers, `index_select`s into one staging tensor on the owner's GPU, one peer copy, `index_copy_`s on ours
(`copy_blocks`). Otherwise (another host, the GPU not visible, IPC refused) the decode worker pulls over the
data plane.

Ordering: the owner's KV writes are complete before the handle leaves it (the prefill step syncs on the
sampled token). The receiver queues its copy on the engine's stream without waiting (the engine thread goes
straight back to stepping; later steps are ordered after the copy on that stream), and sends Release, after
which the owner may reuse the blocks, only once the copy's event has completed.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Sequence

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from deepinfer.engine.core import EngineCore
from deepinfer.host_identity import host_id as host_id  # re-exported (deepinfer.engine.host_id)
from deepinfer.protocol.kv import CudaIpcTensor, KvDeviceExport, KvHandle

log = logging.getLogger(__name__)

#: Most bytes of pulled blocks staged per peer copy (a chunk of layers); bounds the transient memory on each GPU.
STAGING_BYTES = 256 << 20


class DeviceTransferError(RuntimeError):
    """The device path cannot be used for this handle (mapping refused, GPU not visible): use the data plane."""


def _block_dim(kv: torch.Tensor) -> int:
    """The block axis: 1 in [2, num_blocks, bs, H, D] caches, 0 in latent [num_blocks, bs, C]."""
    return 0 if kv.dim() == 3 else 1


def copy_blocks(
    src_caches: Sequence[torch.Tensor],
    src_block_ids: Sequence[int],
    dst_caches: Sequence[torch.Tensor],
    dst_block_ids: Sequence[int],
    *,
    staging_bytes: int = STAGING_BYTES,
) -> None:
    """dst[dst_block_ids[i]] = src[src_block_ids[i]] in every layer.

    The caches may live on different devices (CPU, or two GPUs: the copy between them is a peer copy).
    Block shapes and dtypes must agree; the number of blocks per cache may differ. Layers go in chunks of at
    most `staging_bytes` of pulled blocks: gather a chunk's layers into one staging tensor on the source
    device, one peer copy of it, scatter on the destination. One large copy instead of one per layer keeps
    the link busy (each cross-device copy waits on both devices' streams).
    """
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"{len(src_caches)} source layers but {len(dst_caches)} destination layers")
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} source block ids but {len(dst_block_ids)} destination ids")
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise ValueError(f"duplicate destination block ids in {list(dst_block_ids)}")
    if not src_block_ids:
        return
    for layer, (src, dst) in enumerate(zip(src_caches, dst_caches, strict=True)):
        dim = _block_dim(src)
        src_block = src.shape[:dim] + src.shape[dim + 1 :]
        dst_block = dst.shape[:dim] + dst.shape[dim + 1 :]
        if src.dim() != dst.dim() or src_block != dst_block or src.dtype != dst.dtype:
            raise ValueError(
                f"layer {layer}: source {tuple(src.shape)} {src.dtype} and destination {tuple(dst.shape)} "
                f"{dst.dtype} hold different blocks"
            )
    src_index = _index(src_caches[0], src_block_ids)
    dst_index = _index(dst_caches[0], dst_block_ids)
    first, dim = src_caches[0], _block_dim(src_caches[0])
    pulled_shape = first.shape[:dim] + (len(src_block_ids),) + first.shape[dim + 1 :]  # one layer's pulled blocks
    layer_bytes = math.prod(pulled_shape) * first.element_size()
    layers_per_chunk = max(1, staging_bytes // layer_bytes)
    for start in range(0, len(src_caches), layers_per_chunk):
        chunk = range(start, min(start + layers_per_chunk, len(src_caches)))
        staging = torch.empty((len(chunk), *pulled_shape), dtype=first.dtype, device=first.device)
        for j, layer in enumerate(chunk):
            torch.index_select(src_caches[layer], dim, src_index, out=staging[j])
        moved = staging.to(dst_caches[0].device, non_blocking=True)
        for j, layer in enumerate(chunk):
            dst_caches[layer].index_copy_(dim, dst_index, moved[j])


def _index(cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    num_blocks = cache.shape[_block_dim(cache)]
    for block_id in block_ids:
        if not 1 <= int(block_id) < num_blocks:
            raise ValueError(f"block id {block_id} outside [1, {num_blocks}) (block 0 is the padding block)")
    return torch.tensor([int(b) for b in block_ids], dtype=torch.long, device=cache.device)


# -- export (owner) -------------------------------------------------------------------------------------------
def describe_reduced(args: tuple, device_uuid: str = "") -> CudaIpcTensor:
    """The wire fields of `reduce_tensor(t)[1]` (rebuild_cuda_tensor's arguments) for a CUDA tensor."""
    (_tensor_cls, size, stride, tensor_offset, _storage_cls, dtype, device, storage_handle, storage_size_bytes,
     storage_offset_bytes, _requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    return CudaIpcTensor(
        device=int(device),
        device_uuid=device_uuid,
        storage_handle=bytes(storage_handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync_required),
        dtype=str(dtype).removeprefix("torch."),
        shape=[int(n) for n in size],
        stride=[int(s) for s in stride],
        storage_offset=int(tensor_offset),
    )


def rebuild_args(desc: CudaIpcTensor, device: int) -> tuple:
    """`rebuild_cuda_tensor`'s arguments for a description, opened on local device index `device`."""
    dtype = getattr(torch, desc.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise DeviceTransferError(f"unknown dtype {desc.dtype!r}")
    return (
        torch.Tensor, torch.Size(desc.shape), tuple(desc.stride), desc.storage_offset, torch.UntypedStorage,
        dtype, device, desc.storage_handle, desc.storage_size_bytes, desc.storage_offset_bytes, False,
        desc.ref_counter_handle, desc.ref_counter_offset, desc.event_handle, desc.event_sync_required,
    )


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def export_caches(kv_caches: Sequence[torch.Tensor], host: str) -> KvDeviceExport:
    """Export every layer's cache for CUDA IPC (once, at start: the caches live as long as the worker)."""
    if not kv_caches or kv_caches[0].device.type != "cuda":
        raise DeviceTransferError("only CUDA caches can be exported")
    layers = []
    for kv in kv_caches:
        _rebuild, args = reduce_tensor(kv)
        layers.append(describe_reduced(args, _device_uuid(kv.device.index)))
    return KvDeviceExport(host_id=host, export_id=uuid.uuid4().hex, layers=layers)


def export_for_handles(core: EngineCore, host: str) -> KvDeviceExport | None:
    """The owner's export for its KvHandles, or None (CPU caches, tensor parallel, IPC refused): data plane only.

    Run on the engine thread, once at start.
    """
    if core.runner.device.type != "cuda" or core.args.tensor_parallel_size > 1:
        return None  # a TP owner's cache is sharded; the data plane has the same rank-0-only limit
    try:
        return export_caches(core.runner.kv_caches, host)
    except RuntimeError as exc:
        log.warning("KV cache not exported for CUDA IPC (%s): decode workers will use the data plane", exc)
        return None


# -- import (receiver) ----------------------------------------------------------------------------------------
def local_device_of(desc: CudaIpcTensor) -> int:
    """This process's index of the owner's GPU (matched by UUID: CUDA_VISIBLE_DEVICES may renumber)."""
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == desc.device_uuid:
            return index
    raise DeviceTransferError(f"the owner's GPU {desc.device_uuid or desc.device} is not visible here")


def map_export(export: KvDeviceExport) -> list[torch.Tensor]:
    """The owner's caches as tensors on its GPU, in this process's address space (CUDA IPC)."""
    if not torch.cuda.is_available():
        raise DeviceTransferError("CUDA is not available here")
    caches = []
    for desc in export.layers:
        try:
            caches.append(rebuild_cuda_tensor(*rebuild_args(desc, local_device_of(desc))))
        except RuntimeError as exc:  # cudaIpcOpenMemHandle refused (other container, no peer access, ...)
            raise DeviceTransferError(f"CUDA IPC mapping failed: {exc}") from exc
    return caches


class PeerCaches:
    """A receiver's owner caches mapped by export id: each export is opened once and kept."""

    def __init__(self, local_host_id: str) -> None:
        self.local_host_id = local_host_id
        self._mapped: dict[str, list[torch.Tensor]] = {}
        self._refused: set[str] = set()

    def usable(self, handle: KvHandle, local_device: torch.device) -> bool:
        """True if this handle's blocks may be copied device to device into caches on `local_device`."""
        export = handle.device_transfer
        return (
            export is not None
            and export.host_id == self.local_host_id
            and export.export_id not in self._refused
            and local_device.type == "cuda"
            and len(export.layers) == handle.layout.num_layers
        )

    def get(self, export: KvDeviceExport) -> list[torch.Tensor]:
        """The mapped caches of this export (mapping them on first use); DeviceTransferError if impossible."""
        caches = self._mapped.get(export.export_id)
        if caches is None:
            try:
                caches = map_export(export)
            except DeviceTransferError:
                self._refused.add(export.export_id)
                raise
            self._mapped[export.export_id] = caches
            log.info("mapped the KV cache of export %s (%d layers) by CUDA IPC", export.export_id, len(caches))
        return caches

    def clear(self) -> None:
        """Drop every mapping (the owner's memory stays the owner's)."""
        self._mapped.clear()


def copy_into(dst_caches: Sequence[torch.Tensor], src_caches: Sequence[torch.Tensor], src_block_ids: Sequence[int],
              dst_block_ids: Sequence[int]) -> list[torch.cuda.Event]:
    """Copy the source's last len(dst_block_ids) blocks of `src_block_ids` into `dst_block_ids` (an admission's
    `fill`: local prefix hits were skipped at its start). Queued on the engine's stream without waiting: the
    steps after it see the KV; the owner's blocks may be reused only once the returned event has completed
    (no event for CPU caches)."""
    copy_blocks(src_caches, src_block_ids[len(src_block_ids) - len(dst_block_ids) :], dst_caches, dst_block_ids)
    if dst_caches[0].device.type != "cuda":
        return []
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(dst_caches[0].device))
    return [event]
