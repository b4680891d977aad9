"""KV layout and the handle that names a request's KV blocks on their owner (docs/architecture.md §4)."""

from __future__ import annotations

from pydantic import Field, model_validator

from deepinfer import hashing
from deepinfer.protocol.base import Message
from deepinfer.protocol.types import BlockHash, NonNegativeInt


class KvLayout(Message):
    """Shape and dtype of one KV block; the same tokens under another layout are another object."""

    kind = "kv_layout"

    dtype: str
    block_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=0)
    head_dim: int = Field(ge=0)
    #: Memory order of one block, e.g. "nhd" = [block_size, num_kv_heads, head_dim].
    kv_layout: str = "nhd"
    #: Set for latent-attention models (MLA), whose cache holds a latent vector instead of heads.
    latent_dim: int | None = Field(None, ge=1)

    def layout_id(self) -> str:
        """Short stable id of this layout: `deepinfer.hashing.layout_id`, the one definition of it."""
        return hashing.layout_id(
            self.dtype, self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.kv_layout,
            self.latent_dim,
        )


class CudaIpcTensor(Message):
    """One CUDA tensor shared by IPC: the fields of `torch.multiprocessing.reductions.reduce_tensor`, no pickle."""

    kind = "cuda_ipc_tensor"

    #: Owner's device index and its GPU UUID (the receiver maps the UUID to its own index).
    device: int = Field(ge=0)
    device_uuid: str = ""
    storage_handle: bytes
    storage_size_bytes: int = Field(ge=0)
    storage_offset_bytes: int = Field(ge=0)
    ref_counter_handle: bytes
    ref_counter_offset: int = Field(ge=0)
    event_handle: bytes | None = None
    event_sync_required: bool = False
    dtype: str
    shape: list[int]
    stride: list[int]
    #: Tensor offset in its storage, in elements.
    storage_offset: int = Field(0, ge=0)


class KvDeviceExport(Message):
    """The owner's KV cache exported for same-host device-to-device pulls (one CudaIpcTensor per layer)."""

    kind = "kv_device_export"

    #: Where the owner runs; a receiver on another host id uses the data plane.
    host_id: str
    #: Changes whenever the owner re-exports (restart): receivers map each export once.
    export_id: str
    layers: list[CudaIpcTensor] = Field(default_factory=list)


class KvHandle(Message):
    """Self-describing reference to KV blocks held (and leased) by their owner worker."""

    kind = "kv_handle"

    request_id: str
    #: Hashes of the full blocks (num_tokens // block_size of them).
    block_hashes: list[BlockHash] = Field(default_factory=list)
    #: Block ids in the owner's pool, covering all num_tokens (the last may be partial); meaningless elsewhere.
    block_ids: list[int] = Field(default_factory=list)
    num_tokens: NonNegativeInt
    owner_worker_id: str
    #: "host:port" of the owner's data plane.
    data_plane_address: str
    layout: KvLayout
    layout_id: str
    #: Owner's clock; receivers treat it as advisory (an expired lease means recompute).
    lease_expires_at_unix_s: float
    #: Set when the owner exported its cache for CUDA IPC: a receiver on the same host may copy the blocks
    #: device to device instead of pulling them over the data plane (added in 1.0; old readers ignore it).
    device_transfer: KvDeviceExport | None = None
    #: The owner leases these blocks to transfer engines (a `lease` by block id on its data plane, which alone names
    #: the engine's session and addresses: none travel here) and the host it runs on (`deepinfer.host_identity`).
    transfer_engine: bool = False
    host_id: str = ""

    @model_validator(mode="after")
    def _layout_id_matches(self) -> KvHandle:
        if self.layout_id != self.layout.layout_id():
            raise ValueError(f"layout_id {self.layout_id!r} does not match layout ({self.layout.layout_id()})")
        # Ids cover every token (the last block may be partial); hashes name full blocks only.
        block_size = self.layout.block_size
        if len(self.block_ids) != -(-self.num_tokens // block_size):
            raise ValueError(f"{len(self.block_ids)} block_ids for {self.num_tokens} tokens of {block_size}")
        if len(self.block_hashes) != self.num_tokens // block_size:
            raise ValueError(f"{len(self.block_hashes)} block_hashes for {self.num_tokens} tokens of {block_size}")
        return self
