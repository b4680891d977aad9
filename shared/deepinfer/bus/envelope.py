"""What both bus implementations do around a payload: encode, trace headers, size check, decode, dispatch."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context

from deepinfer.bus.errors import MessageDecodeError, PayloadTooLarge
from deepinfer.bus.interface import Handler, IncomingMsg, M
from deepinfer.protocol.base import Message, ProtocolError

#: W3C trace context header names carried in NATS headers.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_HEADER_LINE = b"NATS/1.0\r\n"


def encode_payload(message: Message | bytes) -> bytes:
    """The wire bytes of a message (msgpack) or the bytes themselves."""
    if isinstance(message, Message):
        return message.to_bytes()
    if isinstance(message, bytes | bytearray | memoryview):
        return bytes(message)
    raise TypeError(f"expected a Message or bytes, got {type(message).__name__}")


def outgoing_headers(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """Caller headers plus the current OpenTelemetry context (`traceparent`, `tracestate`); None if empty.

    The context is injected only when it holds a valid span context (or baggage): with the exporter none and no
    caller's trace, nothing is current, so a publish costs no propagator call and sends no headers."""
    carrier: dict[str, str] = dict(headers) if headers else {}
    context = otel_context.get_current()
    if context and (trace.get_current_span(context).get_span_context().is_valid or baggage.get_all(context)):
        propagate.inject(carrier, context)
    return carrier or None


def header_size_bytes(headers: Mapping[str, str] | None) -> int:
    """Size of the NATS header block as nats-py writes it (`NATS/1.0` line, `k: v` lines, blank line)."""
    if not headers:
        return 0
    size = len(_HEADER_LINE) + 2
    for key, value in headers.items():
        size += len(key.strip().encode()) + 2 + len(value.strip().encode()) + 2
    return size


def check_size(subject: str, payload: bytes, headers: Mapping[str, str] | None, max_bytes: int) -> None:
    """Raise PayloadTooLarge when payload + headers exceed the server's max_payload (the server counts both)."""
    size_bytes = len(payload) + header_size_bytes(headers)
    if size_bytes > max_bytes:
        raise PayloadTooLarge(subject, size_bytes, max_bytes)


def decode(subject: str, data: bytes, message_type: type[M]) -> M:
    """Decode a payload as `message_type`; MessageDecodeError (a ProtocolError) names the subject."""
    try:
        return message_type.from_bytes(data)
    except ProtocolError as exc:
        raise MessageDecodeError(subject, str(exc)) from exc


async def dispatch(
    handler: Handler,
    msg: IncomingMsg,
    message_type: type[Message] | None,
    logger: logging.Logger,
) -> None:
    """Run `handler` on one message inside the sender's trace context; log (never raise) its failures.

    A message without headers carries no trace context: the handler runs in an empty one, attached only if the
    subscription's task inherited a non-empty one (so the common untraced message costs no attach/detach)."""
    headers = msg.headers
    if headers:
        token = otel_context.attach(propagate.extract(headers))
    elif otel_context.get_current():
        token = otel_context.attach(otel_context.Context())
    else:
        token = None
    try:
        message = msg.data if message_type is None else decode(msg.subject, msg.data, message_type)
        await handler(message, msg)
    except MessageDecodeError as exc:
        logger.error("dropped undecodable message on %s: %s", msg.subject, exc)
    except Exception:
        logger.exception("handler %s failed on a message on %s", _name(handler), msg.subject)
    finally:
        if token is not None:
            otel_context.detach(token)


def _name(handler: Handler) -> str:
    return getattr(handler, "__qualname__", None) or repr(handler)
