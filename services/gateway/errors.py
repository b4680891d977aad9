"""OpenAI's error object `{"error": {"message", "type", "param", "code"}}`, from an `ErrorCode` through one table.

Every failure the gateway reports, before or during a stream, is an `ApiError` carrying an `ErrorCode` (its
own, or a worker's from the wire); `HTTP_ERRORS` decides the HTTP status, OpenAI's error type and code.
Nothing else reaches the client (a bug becomes a 500 with a request id, never a traceback).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from deepinfer.protocol import ErrorCode, ErrorDetail


@dataclass(frozen=True)
class HttpError:
    """How one ErrorCode is reported: HTTP status, OpenAI error type, OpenAI error code, Retry-After or not."""

    status_code: int
    type: str
    code: str | None
    retryable: bool = False


#: The one table from error codes to what the client sees (429s and 503s carry Retry-After; OpenAI's SDKs retry
#: them).
HTTP_ERRORS: dict[ErrorCode, HttpError] = {
    ErrorCode.BAD_REQUEST: HttpError(400, "invalid_request_error", None),
    ErrorCode.CONTEXT_LENGTH: HttpError(400, "invalid_request_error", "context_length_exceeded"),
    ErrorCode.UNAUTHORIZED: HttpError(401, "invalid_request_error", "invalid_api_key"),
    ErrorCode.NOT_FOUND: HttpError(404, "invalid_request_error", "not_found"),
    ErrorCode.PAYLOAD_TOO_LARGE: HttpError(413, "invalid_request_error", "request_too_large"),
    ErrorCode.RATE_LIMITED: HttpError(429, "requests", "rate_limit_exceeded", retryable=True),
    ErrorCode.CANCELLED: HttpError(499, "invalid_request_error", "cancelled"),
    ErrorCode.INTERNAL: HttpError(500, "server_error", "internal_error"),
    ErrorCode.WORKER_LOST: HttpError(502, "server_error", "upstream_error"),
    ErrorCode.OVERLOADED: HttpError(503, "overloaded_error", "overloaded", retryable=True),
    ErrorCode.LAYOUT_MISMATCH: HttpError(503, "overloaded_error", "layout_mismatch", retryable=True),
    ErrorCode.TIMEOUT: HttpError(504, "server_error", "timeout"),
}


class ApiError(Exception):
    """An error to report to the client in OpenAI's format; status, type and code come from `HTTP_ERRORS`."""

    def __init__(
        self,
        error_code: ErrorCode,
        message: str,
        param: str | None = None,
        *,
        code: str | None = None,
        error_type: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        http = HTTP_ERRORS[error_code]
        self.error_code = error_code
        self.message = message
        self.param = param
        self.status_code = http.status_code
        #: OpenAI's finer type where one code has several (a 429's "requests" or "tokens").
        self.type = error_type or http.type
        #: OpenAI's finer code when the table's is too coarse (e.g. model_not_found for a NOT_FOUND).
        self.code = code or http.code
        self.retry_after_s = retry_after_s if http.retryable else None
        #: More headers of the response (a 429's x-ratelimit-*).
        self.extra_headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Retry-After (whole seconds, at least 1) on retryable errors, and any extra headers."""
        if self.retry_after_s is None:
            return dict(self.extra_headers)
        return {**self.extra_headers, "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def response(self) -> JSONResponse:
        """A JSONResponse carrying the error object, its status and headers."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers())

    def sse_event(self) -> str:
        """The error as one SSE event, for a stream that already started (HTTP status is 200 by then)."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def from_wire(error: ErrorDetail, where: str, retry_after_s: float) -> ApiError:
    """A worker's typed error or refusal as the client sees it (`where`: which hop, for the message)."""
    return ApiError(error.code, f"{where}: {error.message}", retry_after_s=retry_after_s)


def bad_request(message: str, param: str | None = None) -> ApiError:
    """400 invalid_request_error naming the offending field in `param`."""
    return ApiError(ErrorCode.BAD_REQUEST, message, param)


def context_length(message: str, param: str) -> ApiError:
    """400 context_length_exceeded: the prompt (plus max_tokens) does not fit the model."""
    return ApiError(ErrorCode.CONTEXT_LENGTH, message, param)


def unauthorized(message: str) -> ApiError:
    """401 for a missing or wrong API key."""
    return ApiError(ErrorCode.UNAUTHORIZED, message)


def model_not_found(name: str) -> ApiError:
    """404 model_not_found for a model this gateway does not serve."""
    return ApiError(ErrorCode.NOT_FOUND, f"The model '{name}' does not exist", "model", code="model_not_found")


def too_large(max_bytes: int) -> ApiError:
    """413 request body over the limit."""
    return ApiError(ErrorCode.PAYLOAD_TOO_LARGE, f"request body exceeds {max_bytes} bytes")


def overloaded(message: str, retry_after_s: float) -> ApiError:
    """503 capacity error with Retry-After (OpenAI's SDKs retry it)."""
    return ApiError(ErrorCode.OVERLOADED, message, retry_after_s=retry_after_s)


def worker_lost(message: str) -> ApiError:
    """502 a worker failed or went silent after accepting the request."""
    return ApiError(ErrorCode.WORKER_LOST, message)


def timed_out(timeout_s: float) -> ApiError:
    """504 the request ran past request_timeout_s (the workers are told to drop it)."""
    return ApiError(ErrorCode.TIMEOUT, f"the request did not finish within request_timeout_s={timeout_s:g} s")


def client_gone() -> ApiError:
    """499 the client closed the connection while the request waited on a worker (nobody reads this)."""
    return ApiError(ErrorCode.CANCELLED, "the client closed the connection")


def internal(request_id: str) -> ApiError:
    """500 with no detail beyond the request id (details stay in the logs)."""
    return ApiError(ErrorCode.INTERNAL, f"internal error (request id {request_id})")


def from_validation_error(exc: ValidationError) -> ApiError:
    """400 for the first invalid field of a request body, `param` = its dotted path. Of a union's errors, one saying
    more than "wrong type" (the branches the value was never meant for) is preferred."""
    errors = exc.errors()
    first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    param = ".".join(str(part) for part in first["loc"] if not _is_union_tag(part)) or None
    message = str(first["msg"])
    if param:
        message = f"{param}: {message}"
    return bad_request(message, param)


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the union member's type name ("str", "list[int]") in the loc of union errors.
    return isinstance(part, str) and (
        part in {"str", "int", "list", "function-after"} or "[" in part or part.startswith("constrained-")
    )
