"""Typed messages of every internal boundary (docs/architecture.md §3), msgpack on the wire."""

from deepinfer.protocol.base import PROTOCOL_MAJOR, PROTOCOL_MINOR, Message, ProtocolError
from deepinfer.protocol.errors import ErrorCode, ErrorDetail
from deepinfer.protocol.kv import KvHandle, KvLayout
from deepinfer.protocol.kv_events import (
    MAX_SNAPSHOT_PAGE_SIZE,
    KvEvent,
    KvEventBatch,
    KvEventKind,
    KvTier,
    SnapshotPage,
    SnapshotRequest,
)
from deepinfer.protocol.requests import (
    Cancel,
    DecodeAccepted,
    DecodeRequest,
    DecodeStatus,
    PrefillRequest,
    PrefillResult,
    Release,
)
from deepinfer.protocol.routing import RouteDecision, RouteRequest, RouteStatus
from deepinfer.protocol.sampling import WireSamplingParams
from deepinfer.protocol.store import KvLookupReply, KvLookupRequest, KvStoreEventBatch, KvStoreHeartbeat
from deepinfer.protocol.token_wire import TokenBatchWriter, chunk_prefix
from deepinfer.protocol.tokens import (
    FinishReason,
    PromptLogprobs,
    TokenBatch,
    TokenChunk,
    TokenLogprobs,
    encode_token_batch,
    token_chunk_fields,
)
from deepinfer.protocol.types import BLOCK_HASH_BYTES, BlockHash
from deepinfer.protocol.workers import WorkerLoad, WorkerRole

__all__ = [
    "BLOCK_HASH_BYTES",
    "MAX_SNAPSHOT_PAGE_SIZE",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "BlockHash",
    "Cancel",
    "DecodeAccepted",
    "DecodeRequest",
    "DecodeStatus",
    "ErrorCode",
    "ErrorDetail",
    "FinishReason",
    "KvEvent",
    "KvEventBatch",
    "KvEventKind",
    "KvHandle",
    "KvLayout",
    "KvLookupReply",
    "KvLookupRequest",
    "KvStoreEventBatch",
    "KvStoreHeartbeat",
    "KvTier",
    "Message",
    "PrefillRequest",
    "PrefillResult",
    "PromptLogprobs",
    "ProtocolError",
    "Release",
    "RouteDecision",
    "RouteRequest",
    "RouteStatus",
    "WireSamplingParams",
    "SnapshotPage",
    "SnapshotRequest",
    "TokenBatch",
    "TokenBatchWriter",
    "TokenChunk",
    "TokenLogprobs",
    "chunk_prefix",
    "encode_token_batch",
    "token_chunk_fields",
    "WorkerLoad",
    "WorkerRole",
]
