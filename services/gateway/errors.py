"""OpenAI's error object `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

Every failure the gateway reports, before or during a stream, is an `ApiError`; nothing else reaches the client
(a bug becomes a 500 with a request id, never a traceback).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error to report to the client in OpenAI's format."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Retry-After (whole seconds, at least 1) on overload errors."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def response(self) -> JSONResponse:
        """A JSONResponse carrying the error object, its status and headers."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers())

    def sse_event(self) -> str:
        """The error as one SSE event, for a stream that already started (HTTP status is 200 by then)."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400 invalid_request_error naming the offending field in `param`."""
    return ApiError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str) -> ApiError:
    """401 for a missing or wrong API key."""
    return ApiError(401, message, "invalid_request_error", None, "invalid_api_key")


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """404 unknown model or route."""
    return ApiError(404, message, "invalid_request_error", param, code)


def too_large(max_bytes: int) -> ApiError:
    """413 request body over the limit."""
    return ApiError(413, f"request body exceeds {max_bytes} bytes", "invalid_request_error", None, "request_too_large")


def overloaded(message: str, retry_after_s: float | None = 1.0) -> ApiError:
    """503 capacity error with Retry-After (OpenAI's SDKs retry it)."""
    return ApiError(503, message, "overloaded_error", None, "overloaded", retry_after_s=retry_after_s)


def upstream_failed(message: str) -> ApiError:
    """502 a worker failed or went silent after accepting the request."""
    return ApiError(502, message, "server_error", None, "upstream_error")


def internal(request_id: str) -> ApiError:
    """500 with no detail beyond the request id (details stay in the logs)."""
    return ApiError(500, f"internal error (request id {request_id})", "server_error", None, "internal_error")


def from_validation_error(exc: ValidationError) -> ApiError:
    """400 for the first invalid field of a request body, `param` = its dotted path."""
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"] if not _is_union_tag(part)) or None
    message = str(first["msg"])
    if param:
        message = f"{param}: {message}"
    return bad_request(message, param)


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the union member's type name ("str", "list[int]") in the loc of union errors.
    return isinstance(part, str) and (part in {"str", "int", "list", "function-after"} or "[" in part)
