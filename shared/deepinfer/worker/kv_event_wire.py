"""A worker's KV event batch as wire bytes, written from the block pool's events without building models.

The bytes are `KvEventBatch(...).to_bytes()`'s, field for field (tests/unit/test_worker_step_path.py checks):
with 64 requests filling a block in the same step, a batch of 64 `Stored` events cost ~140 µs of the event
loop as pydantic models (one step's GIL time every block_size steps), a fraction of that as plain fields. The
hashes come from this worker's own block pool, so there is nothing to validate; the scheduler decodes the
batch with the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

from deepinfer.engine import AllCleared, KvCacheEvent, Removed, Stored
from deepinfer.protocol import KvEventKind, KvTier, Message

_VERSION = Message.model_fields["v"].default
_STORED, _REMOVED, _ALL_CLEARED = KvEventKind.STORED.value, KvEventKind.REMOVED.value, KvEventKind.ALL_CLEARED.value
_DEVICE = KvTier.DEVICE.value


def encode_kv_event_batch(worker_id: str, seq: int, events: Sequence[KvCacheEvent], ts: float, epoch: str) -> bytes:
    """The wire bytes of `KvEventBatch(worker_id, seq, events as KvEvents of their tier, device or host, ts,
    epoch)`."""
    wire = []
    for event in events:
        if isinstance(event, Stored):
            wire.append({"v": _VERSION, "event_kind": _STORED, "block_hashes": list(event.block_hashes),
                         "parent_hash": event.parent_hash, "tier": event.tier})
        elif isinstance(event, Removed):
            wire.append({"v": _VERSION, "event_kind": _REMOVED, "block_hashes": list(event.block_hashes),
                         "parent_hash": None, "tier": event.tier})
        elif isinstance(event, AllCleared):
            wire.append({"v": _VERSION, "event_kind": _ALL_CLEARED, "block_hashes": [], "parent_hash": None,
                         "tier": _DEVICE})
    return msgpack.packb({"v": _VERSION, "worker_id": worker_id, "seq": seq, "events": wire, "ts": ts,
                          "epoch": epoch}, use_bin_type=True)
