"""Errors of the KV data plane; every one derives from DataPlaneError and carries a wire `code`.

A server turns a DataPlaneError raised by its BlockProvider into an error frame with that code; the client
turns the frame back into the same class, so `LeaseExpired` raised by the owner's provider is `LeaseExpired`
at the puller.
"""

from __future__ import annotations

from typing import ClassVar


class DataPlaneError(Exception):
    """Base of every data-plane error; `code` names it on the wire."""

    code: ClassVar[str] = "error"


class DataPlaneAuthError(DataPlaneError):
    """The handshake failed: a wrong secret on either side, or a peer that is not a data plane."""

    code = "auth"


class DataPlaneTimeout(DataPlaneError, TimeoutError):
    """A connect or a request did not finish within its timeout; the connection was dropped."""

    code = "timeout"


class DataPlaneConnectionError(DataPlaneError, ConnectionError):
    """The peer could not be reached, or closed the connection mid-request."""

    code = "connection"


class ChecksumError(DataPlaneError):
    """A block's bytes do not match the xxh3-64 checksum its sender computed."""

    code = "checksum"


class LeaseExpired(DataPlaneError):
    """The request's lease is unknown or has ended on the owner: recompute, never use the bytes."""

    code = "lease_expired"


class BlockNotFound(DataPlaneError):
    """A requested block id or hash is not held by the provider."""

    code = "not_found"


class FrameError(DataPlaneError):
    """A malformed frame: bad msgpack, wrong fields, inconsistent block counts."""

    code = "bad_frame"


class FrameTooLarge(FrameError):
    """A header or payload over the configured limits; refused before anything was allocated for it."""

    code = "too_large"


_BY_CODE: dict[str, type[DataPlaneError]] = {
    cls.code: cls
    for cls in (
        DataPlaneError,
        DataPlaneAuthError,
        DataPlaneTimeout,
        DataPlaneConnectionError,
        ChecksumError,
        LeaseExpired,
        BlockNotFound,
        FrameError,
        FrameTooLarge,
    )
}


def error_from_code(code: str, message: str) -> DataPlaneError:
    """The error a peer's error frame names; an unknown code becomes a plain DataPlaneError."""
    cls = _BY_CODE.get(code, DataPlaneError)
    return cls(message)
