"""The hops of one request: gateway -> prefill, gateway -> decode, decode -> prefill, gateway -> all."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from deepinfer.protocol.base import Message
from deepinfer.protocol.errors import ErrorDetail
from deepinfer.protocol.kv import KvHandle
from deepinfer.protocol.sampling import WireSamplingParams
from deepinfer.protocol.tokens import FinishReason, PromptLogprobs, TokenLogprobs
from deepinfer.protocol.types import BlockHash, NonNegativeInt


class PrefillRequest(Message):
    """Compute a prompt's KV (reusing every cached prefix) and sample the first token."""

    kind = "prefill_request"

    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    sampling: WireSamplingParams = Field(default_factory=WireSamplingParams)
    #: Isolates tenants: part of the first block hash, so salts never share blocks.
    cache_salt: str = ""
    block_hashes: list[BlockHash] = Field(default_factory=list)


class PrefillResult(Message):
    """First token plus a handle to the prompt's KV, leased on the prefill worker."""

    kind = "prefill_result"

    request_id: str
    first_token_id: int | None = None
    first_logprobs: TokenLogprobs | None = None
    kv_handle: KvHandle | None = None
    num_cached_tokens: NonNegativeInt = 0
    #: e.g. {"device": 512, "store": 1024}: where the cached tokens came from.
    cached_tokens_by_tier: dict[str, int] = Field(default_factory=dict)
    #: Set when the first token already ends the request (stop token, max_tokens=1).
    finish_reason: FinishReason | None = None
    #: Set when the prefill failed or was refused (then there is no first token).
    error: ErrorDetail | None = None
    #: The prompt's logprobs, when the request asked for prompt_logprobs (2.7).
    prompt_logprobs: PromptLogprobs | None = None


class DecodeRequest(Message):
    """Continue a request on a decode worker, pulling its KV by handle (or recomputing without one)."""

    kind = "decode_request"

    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    #: Tokens already produced (the first token, or everything sent before a migration).
    output_token_ids: list[int] = Field(default_factory=list)
    sampling: WireSamplingParams = Field(default_factory=WireSamplingParams)
    cache_salt: str = ""
    kv_handle: KvHandle | None = None
    #: Where to send Release once the KV is pulled; None when prefill was skipped.
    prefill_worker_id: str | None = None


class DecodeStatus(StrEnum):
    """A decode worker's answer to a DecodeRequest."""

    ACCEPTED = "accepted"  # in the running batch: tokens follow on the gateway's token subject
    REFUSED = "refused"  # not taken; `error` says why (overloaded, bad request, layout mismatch, ...)


class DecodeAccepted(Message):
    """A decode worker's answer: took the request, or refused it with a typed reason."""

    kind = "decode_accepted"

    request_id: str
    status: DecodeStatus
    #: Why the request was refused: set exactly when status is REFUSED.
    error: ErrorDetail | None = None

    @model_validator(mode="after")
    def _error_iff_refused(self) -> DecodeAccepted:
        if (self.status is DecodeStatus.REFUSED) != (self.error is not None):
            raise ValueError("a refusal carries an error, an acceptance none")
        return self


class Release(Message):
    """Decode -> prefill: the KV was pulled (or is no longer needed), the lease can end."""

    kind = "release"

    request_id: str


class Cancel(Message):
    """Gateway -> every worker: abort the request and drop its references."""

    kind = "cancel"

    request_id: str
    reason: str = "client disconnected"
