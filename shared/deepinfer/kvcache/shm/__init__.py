"""Node-local zero copy: the store shard's RAM tier in shared memory that co-located workers map read-only
(docs/kvstore.md, "Same host: the shared-memory RAM tier"). Torch-free."""

from deepinfer.kvcache.shm.region import SlotReader, SlotRef, SlotRegion, TornRead, key_digest
from deepinfer.kvcache.shm.tier import ShmRamTier, SlotLease

__all__ = ["ShmRamTier", "SlotLease", "SlotReader", "SlotRef", "SlotRegion", "TornRead", "key_digest"]
