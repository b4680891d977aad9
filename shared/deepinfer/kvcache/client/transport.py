"""How a store get's bytes travel: one interface, `LeasedReads`, with the same-host and cross-host paths behind it.

    KvTransport     chosen once per worker (`kv_transport`):
      auto          a shard on this host with its RAM tier in shared memory → shared memory; a shard elsewhere
                    that serves a transfer engine → the transfer engine (when the library loads here); else the
                    data-plane get
      dataplane     always the data-plane get (today's path)
      mooncake      the transfer engine for every shard that serves one, this host's too (one machine standing in
                    for two: tests, benches); the data-plane get for the others
    per shard       KvStoreClient.reads_for(shard) → SharedMemoryReads | TransferEngineReads | None (the data-plane get)
    per handoff     handoff_path(handle): a decode worker's pull of a prefill worker's blocks, the same rules
                    (no shared memory: the transfer engine or the data-plane get)

Both readers lease the blocks over the authenticated data plane (lease / release), copy each leased slot into its
buffer, check the slot's seq and the block's xxh3-64, release; any failure falls back to the data-plane get of the
same blocks (KvStoreClient).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

from deepinfer.dataplane import DataPlaneClient
from deepinfer.dataplane.frames import BytesLike
from deepinfer.kvcache.client.shards import Shard
from deepinfer.protocol import KvHandle


class KvTransport(StrEnum):
    """Which paths a worker's store gets may take (docs/kvstore.md, "Worker settings")."""

    AUTO = "auto"
    DATAPLANE = "dataplane"
    MOONCAKE = "mooncake"


class LeasedReads(Protocol):
    """Gets of leased slots, one reader per path and client (SharedMemoryReads, TransferEngineReads).

    `get` leases the blocks on the shard's data-plane connection, copies them into `into` (or fresh buffers),
    checks each slot's seq and each block's xxh3-64, releases the lease, and raises DataPlaneError on any
    failure (the caller then gets the blocks over the data plane). `close()` drops mappings / registrations.
    """

    num_blocks: int
    num_fallbacks: int

    async def get(self, client: DataPlaneClient, layout_id: str, block_hashes: Sequence[bytes],
                  into: Sequence[memoryview] | None) -> list[BytesLike]: ...

    def close(self) -> None: ...


def path_for(transport: KvTransport, shard: Shard, host_id: str, transfer_engine_loads: bool) -> str:
    """"shm", "transfer_engine" or "dataplane": the path a get from `shard` takes first."""
    return _path(transport, shard.host_id, shard.shm, shard.transfer_engine, host_id, transfer_engine_loads)


def handoff_path(transport: KvTransport, handle: KvHandle, host_id: str, transfer_engine_loads: bool) -> str:
    """"transfer_engine" or "dataplane": the path a decode worker's pull of a prefill worker's blocks takes first
    (the same rules as a store get: the handle says whether its owner leases to transfer engines, and where it
    runs)."""
    return _path(transport, handle.host_id, False, handle.transfer_engine, host_id, transfer_engine_loads)


def _path(transport: KvTransport, peer_host_id: str, shm: bool, transfer_engine: bool, host_id: str,
          transfer_engine_loads: bool) -> str:
    same_host = bool(peer_host_id) and peer_host_id == host_id
    if transport == KvTransport.DATAPLANE:
        return "dataplane"
    if transport == KvTransport.MOONCAKE:
        return "transfer_engine" if transfer_engine and transfer_engine_loads else "dataplane"
    if same_host and shm:
        return "shm"
    if not same_host and transfer_engine and transfer_engine_loads:
        return "transfer_engine"
    return "dataplane"
