"""Worker heartbeats: membership, load and endpoints for the scheduler and gateways."""

from __future__ import annotations

from enum import StrEnum

from deepinfer.protocol.base import Message
from deepinfer.protocol.types import NonNegativeInt, PositiveFloat, PositiveInt


class WorkerRole(StrEnum):
    """What a worker does."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class WorkerLoad(Message):
    """Heartbeat, published every ~1 s; a worker is a member while these keep arriving."""

    kind = "worker_load"

    worker_id: str
    role: WorkerRole
    model: str
    model_fingerprint: bytes
    layout_id: str
    #: Tokens per KV block: gateways hash prompts with it (block identity must agree everywhere).
    block_size: PositiveInt
    #: Most requests the worker batches at once (its admission capacity).
    max_num_seqs: PositiveInt
    #: Longest sequence (prompt + output) the worker accepts.
    max_model_len: PositiveInt
    num_running: NonNegativeInt = 0
    num_waiting: NonNegativeInt = 0
    num_free_blocks: NonNegativeInt = 0
    num_total_blocks: NonNegativeInt = 0
    #: "host:port" of the KV data plane (in Kubernetes, the pod IP).
    data_plane_address: str
    #: "host:port" of /health, /ready, /metrics.
    internal_address: str
    #: Stops taking new work, finishing what it has.
    draining: bool = False
    #: Requests admitted since the worker started (2.2; None from older workers): a router ends its in-flight
    #: counts as this grows, instead of guessing from arrival times.
    num_received: NonNegativeInt | None = None
    #: Boot id of this worker process (2.2): a new epoch is a restart, its KV index entries start over.
    epoch: str = ""
    #: Measured costs (2.8; None from older workers), so the router credits a cached prefix with the seconds it
    #: saves here (deepinfer.kv_costs): bytes of one KV block of every layer, prompt tokens per second computed,
    #: bytes per second of a load from the host tier and from the kvcache store (None: no such tier here).
    kv_bytes_per_block: PositiveInt | None = None
    prefill_tokens_per_s: PositiveFloat | None = None
    host_load_bytes_per_s: PositiveFloat | None = None
    store_load_bytes_per_s: PositiveFloat | None = None
    #: Unix seconds on the worker's clock.
    ts: float
