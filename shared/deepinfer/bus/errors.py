"""Errors of the message bus; every one derives from BusError and names the subject or server involved."""

from __future__ import annotations

from deepinfer.protocol.base import ProtocolError


class BusError(Exception):
    """Base of every error the bus raises."""


class BusConnectError(BusError):
    """No connection to the server could be made within the connect timeout."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot connect to NATS at {url}: {reason}")
        self.url = url


class BusAuthError(BusConnectError):
    """The server refused the credentials (token, user/password); never retried at connect time."""


class BusClosed(BusError):
    """The bus was drained or closed; nothing more can be sent on it."""


class BusTimeout(BusError, TimeoutError):
    """A request got no reply within its timeout (a responder exists but was too slow or died)."""

    def __init__(self, subject: str, timeout_s: float) -> None:
        super().__init__(f"request on {subject!r} got no reply within {timeout_s:g} s")
        self.subject = subject
        self.timeout_s = timeout_s


class NoResponders(BusError):
    """A request found no subscriber on its subject (the server answered at once)."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"no responders on {subject!r}")
        self.subject = subject


class PayloadTooLarge(BusError):
    """An outgoing message (payload + headers) exceeds the server's max_payload; it was not sent."""

    def __init__(self, subject: str, size_bytes: int, max_bytes: int) -> None:
        super().__init__(
            f"message on {subject!r} is {size_bytes} bytes, over the server's max_payload of {max_bytes} bytes; "
            "large data belongs on the data plane, not on NATS"
        )
        self.subject = subject
        self.size_bytes = size_bytes
        self.max_bytes = max_bytes


class MessageDecodeError(BusError, ProtocolError):
    """A received payload is not a valid message of the expected type (also a ProtocolError)."""

    def __init__(self, subject: str, reason: str) -> None:
        super().__init__(f"bad message on {subject!r}: {reason}")
        self.subject = subject
