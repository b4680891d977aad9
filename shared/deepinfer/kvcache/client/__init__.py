"""A worker's client of the kvcache store: the live shard set from heartbeats, rendezvous placement of each block,
batched has / get / put over the data plane (docs/kvstore.md, "Workers")."""

from deepinfer.kvcache.client.client import KvStoreClient, StoreUnavailable
from deepinfer.kvcache.client.shards import Shard, ShardSet
from deepinfer.kvcache.client.transport import KvTransport

__all__ = ["KvStoreClient", "KvTransport", "Shard", "ShardSet", "StoreUnavailable"]
