"""Wire format: pydantic models encoded as msgpack, each carrying a schema version `v`.

Rules (docs/architecture.md §3): receivers ignore unknown fields, so a newer writer can add fields during a rolling
upgrade; a message whose major version is newer than ours is refused with a clear error; a wrong type is a
`ProtocolError`, never a crash. Never pickle.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

import msgpack
from pydantic import BaseModel, ConfigDict, ValidationError

#: Major version of the wire schema this build speaks. Bump on incompatible changes only.
#: 2: errors are typed (ErrorDetail), DecodeAccepted has a status, WorkerLoad's limits are required.
PROTOCOL_MAJOR = 2
#: Minor version: additive changes (new optional fields, new messages) that older readers can ignore.
#: 2.1: KvStoreHeartbeat (the kvcache store's shards announce themselves).
#: 2.2: a worker's boot `epoch` in WorkerLoad, KvEventBatch and SnapshotPage; SnapshotRequest.seq;
#:      WorkerLoad.num_received.
#: 2.3: WireSamplingParams.grammar (structured output; a reader without it ignores it, so the gateway checks outputs).
#: 2.4: TokenChunk.cached_tokens_by_tier (cached prompt tokens by tier: device, store).
#: 2.5: TokenChunk.num_previous_tokens (a gateway sees a lost chunk as a gap), RouteRequest.exclude_worker_ids
#:      (a re-issued request avoids its lost worker; an older scheduler ignores it).
#: 2.6: SnapshotPage.host_block_hashes (a worker's host-memory tier; an older reader sees only the device blocks).
#: 2.7: SamplingParams.prompt_logprobs, PromptLogprobs in PrefillResult and TokenChunk (a request's prompt scored
#:      where it is computed; an older worker ignores the field, so the gateway refuses an answer without them).
#: 2.8: WorkerLoad's measured costs (kv_bytes_per_block, prefill_tokens_per_s, host_load_bytes_per_s,
#:      store_load_bytes_per_s): the router credits a cached prefix with the time it saves on that worker; from an
#:      older worker (None) it falls back to fixed weights.
#: 2.9: KvHandle.transfer_engine and host_id (the owner leases the blocks to transfer engines by id over its data
#:      plane; an older decode worker ignores them and takes the data-plane get).
PROTOCOL_MINOR = 9


class ProtocolError(ValueError):
    """A message could not be decoded: bad msgpack, wrong type, or an unsupported schema version."""


class Message(BaseModel):
    """Base of every message that crosses a process boundary."""

    model_config = ConfigDict(extra="ignore", frozen=False, arbitrary_types_allowed=False)

    #: Schema version "major.minor" of the writer.
    v: str = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"

    kind: ClassVar[str] = "message"

    def to_bytes(self) -> bytes:
        """Encode as msgpack (bytes fields stay raw bytes)."""
        return msgpack.packb(self.model_dump(mode="python"), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        """Decode and validate; raises ProtocolError with the message type and the reason."""
        try:
            raw: Any = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"{cls.__name__}: not valid msgpack ({exc})") from exc
        if not isinstance(raw, dict):
            raise ProtocolError(f"{cls.__name__}: expected a map, got {type(raw).__name__}")
        check_version(cls.__name__, raw.get("v"))
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "<root>"
            raise ProtocolError(f"{cls.__name__}: field {where!r}: {first['msg']}") from exc


def check_version(type_name: str, version: Any) -> None:
    """Refuse a message written by a newer major version of the schema."""
    if version is None:
        raise ProtocolError(f"{type_name}: missing schema version 'v'")
    try:
        major = int(str(version).split(".", 1)[0])
    except ValueError as exc:
        raise ProtocolError(f"{type_name}: bad schema version {version!r}") from exc
    if major > PROTOCOL_MAJOR:
        raise ProtocolError(
            f"{type_name}: schema version {version} is newer than this reader's {PROTOCOL_MAJOR}.x; "
            "upgrade this service"
        )
