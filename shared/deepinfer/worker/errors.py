"""A worker's failures as wire errors: the exception's type picks the code, never its message."""

from __future__ import annotations

from deepinfer.engine import ContextLengthExceeded
from deepinfer.protocol import ErrorCode, ErrorDetail


def error_detail(exc: BaseException, what: str) -> ErrorDetail:
    """`exc` from admitting or running a request: CONTEXT_LENGTH, BAD_REQUEST (a ValueError: the request's own
    values), else INTERNAL. `what` prefixes the message ("invalid sampling", "prefill failed")."""
    if isinstance(exc, ContextLengthExceeded):
        code = ErrorCode.CONTEXT_LENGTH
    elif isinstance(exc, ValueError):
        code = ErrorCode.BAD_REQUEST
    else:
        code = ErrorCode.INTERNAL
    return ErrorDetail(code=code, message=f"{what}: {exc}")
