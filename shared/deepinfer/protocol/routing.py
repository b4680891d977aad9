"""Gateway <-> scheduler: where a request should run."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from deepinfer.protocol.base import Message
from deepinfer.protocol.types import BlockHash, NonNegativeInt


class RouteStatus(StrEnum):
    """Outcome of a routing request."""

    ACCEPTED = "accepted"
    OVERLOADED = "overloaded"  # gateway answers 503 with Retry-After


class RouteRequest(Message):
    """Ask the scheduler for the best (prefill, decode) pair for a prompt."""

    kind = "route_request"

    request_id: str
    gateway_id: str
    block_hashes: list[BlockHash] = Field(default_factory=list)
    num_prompt_tokens: NonNegativeInt
    model_fingerprint: bytes | None = None
    #: Workers to avoid (a migrated request's dead worker); used only while another worker can take it.
    exclude_worker_ids: list[str] = Field(default_factory=list)


class RouteDecision(Message):
    """The scheduler's answer; also published so replicas count each other's in-flight load."""

    kind = "route_decision"

    request_id: str
    status: RouteStatus
    #: None = skip the separate prefill (short prompt, or almost fully cached on the decode worker).
    prefill_worker_id: str | None = None
    decode_worker_id: str | None = None
    expected_cached_tokens: NonNegativeInt = 0
    #: Set when overloaded.
    retry_after_s: float | None = Field(None, ge=0.0)
    scheduler_id: str
