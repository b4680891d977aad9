"""The kvcache store's control plane: lookups and the stored/expired/evicted event stream."""

from __future__ import annotations

from pydantic import Field

from deepinfer.protocol.base import Message
from deepinfer.protocol.types import BlockHash, NonNegativeInt


class KvLookupRequest(Message):
    """Which of these blocks (under this layout) does the shard hold?"""

    kind = "kv_lookup_request"

    # The store keys blocks by (layout_id, hash): the same tokens under another dtype are another object.
    layout_id: str = Field(min_length=1)
    block_hashes: list[BlockHash] = Field(default_factory=list)


class KvLookupReply(Message):
    """One flag per requested hash, in request order."""

    kind = "kv_lookup_reply"

    present: list[bool] = Field(default_factory=list)


class KvStoreHeartbeat(Message):
    """A store shard is alive: where its data plane is and how full it is (added in 2.1; old readers skip it)."""

    kind = "kv_store_heartbeat"

    shard: str = Field(min_length=1)
    #: "host:port" of the shard's data plane (get / put / has by (layout_id, hash)).
    data_plane_address: str
    #: "host:port" of its /health, /ready, /metrics.
    internal_address: str
    num_blocks: NonNegativeInt = 0
    ram_bytes: NonNegativeInt = 0
    ram_capacity_bytes: NonNegativeInt = 0
    disk_bytes: NonNegativeInt = 0
    disk_capacity_bytes: NonNegativeInt = 0
    #: Stops taking puts, finishing what it has.
    draining: bool = False
    #: The shard's host id (hostname/boot id); with `shm`, workers with the same host id may lease its RAM tier's
    #: slots over the data plane and read them from shared memory (docs/kvstore.md; empty from older shards).
    host_id: str = ""
    shm: bool = False
    #: Workers on any host may lease its RAM tier's slots and copy them with a transfer engine (the engine's
    #: session and the addresses are told only in the lease reply, on the authenticated data plane).
    transfer_engine: bool = False
    #: Unix seconds on the shard's clock.
    ts: float


class KvStoreEventBatch(Message):
    """Changes to one shard's set of blocks of one layout; `seq` increases by one per batch."""

    kind = "kv_store_event_batch"

    shard: str
    seq: NonNegativeInt
    layout_id: str = Field(min_length=1)
    stored_block_hashes: list[BlockHash] = Field(default_factory=list)
    expired_block_hashes: list[BlockHash] = Field(default_factory=list)
    evicted_block_hashes: list[BlockHash] = Field(default_factory=list)
    #: Unix seconds on the shard's clock.
    ts: float
