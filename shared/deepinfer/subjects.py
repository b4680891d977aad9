"""NATS subjects (docs/architecture.md §3): the only place their strings are spelled.

`model` arguments take the served model name and make it subject-safe with `model_token`; ids used as
subject tokens (worker_id, gateway_id, shard) must already be safe, else ValueError names the bad id.
"""

from __future__ import annotations

import re

#: Prefix of every DeepInfer subject.
ROOT = "di"
#: Queue group of the scheduler replicas on the route subject: one replica answers each request.
SCHEDULER_QUEUE = "scheduler"
#: The kvcache store's subjects live under di.kvcache.*, so no model may be served under this token.
KVCACHE_TOKEN = "kvcache"

_SAFE_ID = re.compile(r"[a-z0-9_-]+")
_UNSAFE_CHARS = re.compile(r"[^a-z0-9_-]")


def model_token(served_model_name: str) -> str:
    """Subject-safe form of a served model name: lowercase, chars outside a-z0-9_- become '-'."""
    token = _UNSAFE_CHARS.sub("-", served_model_name.lower())
    if not token:
        raise ValueError("served model name must not be empty")
    if token == KVCACHE_TOKEN:
        raise ValueError(f"served model name {served_model_name!r} is reserved (di.kvcache.* is the store's)")
    return token


def is_safe_id(value: str) -> bool:
    """True when `value` can be used as one subject token (non-empty, only a-z0-9_-)."""
    return _SAFE_ID.fullmatch(value) is not None


def check_id(value: str, what: str = "id") -> str:
    """Return `value` if it is a safe subject token, else raise ValueError naming it."""
    if not isinstance(value, str) or not is_safe_id(value):
        raise ValueError(f"invalid {what} {value!r}: use only a-z, 0-9, '_' and '-' (non-empty)")
    return value


def _model(model: str, kind: str) -> str:
    return f"{ROOT}.{model_token(model)}.{kind}"


def route(model: str) -> str:
    """Gateway -> scheduler request/reply (queue group SCHEDULER_QUEUE): RouteRequest -> RouteDecision."""
    return _model(model, "route")


def decisions(model: str) -> str:
    """Scheduler replicas publish their RouteDecisions here to share in-flight load."""
    return _model(model, "decisions")


def prefill(model: str, worker_id: str) -> str:
    """Gateway -> one prefill worker: PrefillRequest -> PrefillResult."""
    return f"{_model(model, 'prefill')}.{check_id(worker_id, 'worker_id')}"


def decode(model: str, worker_id: str) -> str:
    """Gateway -> one decode worker: DecodeRequest -> DecodeAccepted."""
    return f"{_model(model, 'decode')}.{check_id(worker_id, 'worker_id')}"


def tokens(model: str, gateway_id: str) -> str:
    """Decode workers -> one gateway: a TokenBatch per decode step."""
    return f"{_model(model, 'tokens')}.{check_id(gateway_id, 'gateway_id')}"


def release(model: str, worker_id: str) -> str:
    """Decode -> the prefill worker holding the lease: Release."""
    return f"{_model(model, 'release')}.{check_id(worker_id, 'worker_id')}"


def cancel(model: str) -> str:
    """Gateway -> every worker of the model: Cancel."""
    return _model(model, "cancel")


def kv_events(model: str, worker_id: str) -> str:
    """One worker's KvEventBatch stream."""
    return f"{_model(model, 'kv_events')}.{check_id(worker_id, 'worker_id')}"


def kv_events_all(model: str) -> str:
    """Wildcard over every worker's KvEventBatch stream (the scheduler subscribes here)."""
    return f"{_model(model, 'kv_events')}.*"


def snapshot(model: str, worker_id: str) -> str:
    """Scheduler -> one worker: SnapshotRequest -> SnapshotPage."""
    return f"{_model(model, 'snapshot')}.{check_id(worker_id, 'worker_id')}"


def heartbeat(model: str, worker_id: str) -> str:
    """One worker's WorkerLoad heartbeats."""
    return f"{_model(model, 'heartbeat')}.{check_id(worker_id, 'worker_id')}"


def heartbeat_all(model: str) -> str:
    """Wildcard over every worker's heartbeats."""
    return f"{_model(model, 'heartbeat')}.*"


#: Second tokens under di.kvcache that are streams, not shards: no shard may take these names.
_RESERVED_SHARDS = frozenset({"events", "heartbeat"})


def _check_shard(shard: str) -> str:
    check_id(shard, "shard")
    if shard in _RESERVED_SHARDS:  # di.kvcache.events.<x> / .heartbeat.<x> are streams, not a shard's subjects
        raise ValueError(f"invalid shard {shard!r}: the name is reserved")
    return shard


def kvcache_lookup(shard: str) -> str:
    """Request/reply to one store shard: KvLookupRequest -> KvLookupReply."""
    return f"{ROOT}.{KVCACHE_TOKEN}.{_check_shard(shard)}.lookup"


def kvcache_events(shard: str) -> str:
    """One store shard's KvStoreEventBatch stream."""
    return f"{ROOT}.{KVCACHE_TOKEN}.events.{_check_shard(shard)}"


def kvcache_events_all() -> str:
    """Wildcard over every store shard's events."""
    return f"{ROOT}.{KVCACHE_TOKEN}.events.*"


def kvcache_heartbeat(shard: str) -> str:
    """One store shard's KvStoreHeartbeat (every ~1 s; clients derive the live shard set from these)."""
    return f"{ROOT}.{KVCACHE_TOKEN}.heartbeat.{_check_shard(shard)}"


def kvcache_heartbeat_all() -> str:
    """Wildcard over every store shard's heartbeats (not per model: one store serves every model)."""
    return f"{ROOT}.{KVCACHE_TOKEN}.heartbeat.*"
