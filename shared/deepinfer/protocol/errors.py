"""Why a request failed or was refused, as a code every hop understands (docs/architecture.md §9).

Errors cross process boundaries as an `ErrorCode` plus a message for humans; nobody parses the message. The
gateway maps each code to one HTTP status in one table (`services/gateway/errors.py`).
"""

from __future__ import annotations

from enum import StrEnum

from deepinfer.protocol.base import Message


class ErrorCode(StrEnum):
    """What went wrong, from the client's point of view (what to fix, or whether to retry)."""

    #: The request asks for something invalid (a sampling value, a token id): never retried.
    BAD_REQUEST = "bad_request"
    #: The prompt (plus the tokens to generate) does not fit the model's context length.
    CONTEXT_LENGTH = "context_length"
    #: No credentials, or wrong ones (gateway only).
    UNAUTHORIZED = "unauthorized"
    #: An unknown model or route (gateway only).
    NOT_FOUND = "not_found"
    #: The request body is over the size limit (gateway only).
    PAYLOAD_TOO_LARGE = "payload_too_large"
    #: Over the API key's requests or tokens per minute (gateway only): retry after the Retry-After.
    RATE_LIMITED = "rate_limited"
    #: No capacity now (full, draining, no worker): retry later, possibly elsewhere.
    OVERLOADED = "overloaded"
    #: The KV handle's layout is not the receiver's (a routing mismatch): retry on another pair.
    LAYOUT_MISMATCH = "layout_mismatch"
    #: The request was cancelled (client gone, a stop string, the gateway gave up) while a worker ran it.
    CANCELLED = "cancelled"
    #: A worker died or went silent after it accepted the request.
    WORKER_LOST = "worker_lost"
    #: The request ran past its deadline (`request_timeout_s`).
    TIMEOUT = "timeout"
    #: A bug or an engine failure; details are in the worker's log.
    INTERNAL = "internal"


class ErrorDetail(Message):
    """A failure or refusal: its code, and a message for logs and the client (never parsed)."""

    kind = "error_detail"

    code: ErrorCode
    message: str = ""
