"""`Bus`: the MessageBus over a real NATS server (nats-py), with typed errors and trace propagation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Iterator, Mapping

from nats import errors as nats_errors
from nats.aio import client as nats_client
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.aio.transport import TcpTransport

from deepinfer.bus.envelope import check_size, decode, dispatch, encode_payload, outgoing_headers
from deepinfer.bus.errors import (
    BusAuthError,
    BusClosed,
    BusConnectError,
    BusError,
    BusTimeout,
    NoResponders,
    PayloadTooLarge,
)
from deepinfer.bus.interface import Handler, IncomingMsg, M
from deepinfer.protocol.base import Message

logger = logging.getLogger(__name__)

_SUBSCRIBE_CONFIRM_TIMEOUT_S = 2.0
#: Subjects `publish_now` has checked (more: the set starts again).
_MAX_CHECKED_SUBJECTS = 1024
_CRLF = b"\r\n"


class BusSubscription:
    """A live subscription on a `Bus`; `unsubscribe()` is idempotent."""

    def __init__(self, sub: NatsSubscription, subject: str, queue: str | None) -> None:
        self._sub = sub
        self.subject = subject
        self.queue = queue

    async def unsubscribe(self) -> None:
        """Stop delivery; messages already queued for the handler are dropped."""
        with contextlib.suppress(nats_errors.Error):
            await self._sub.unsubscribe()


class _ConnectionEvents:
    """nats-py callbacks: log the connection's life; during the first connect, catch a refused login."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url
        self.connected = False
        self.closing = False
        self.reconnecting = False
        self.num_reconnects = 0
        self.last_error: Exception | None = None
        self.auth_refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

    async def on_error(self, exc: Exception) -> None:
        if not self.connected:
            # nats-py retries the first connect forever when max_reconnect_attempts < 0; Bus.connect bounds it.
            self.last_error = exc
            if _is_auth_error(exc) and not self.auth_refused.done():
                self.auth_refused.set_result(exc)
            return
        # While reconnecting, every failed attempt reports here (every reconnect_wait_s): keep those quiet.
        level = logging.DEBUG if self.reconnecting else logging.WARNING
        logger.log(level, "bus %s: NATS error: %r", self.name, exc)

    async def on_disconnected(self) -> None:
        if self.connected and not self.closing:
            self.reconnecting = True
            logger.warning("bus %s: disconnected from %s, reconnecting", self.name, self.url)

    async def on_reconnected(self) -> None:
        self.reconnecting = False
        self.num_reconnects += 1
        logger.warning("bus %s: reconnected to %s", self.name, self.url)

    async def on_closed(self) -> None:
        if self.connected:
            logger.info("bus %s: connection closed", self.name)


class Bus:
    """The MessageBus over NATS. Build with `await Bus.connect(...)`; see `MessageBus` for the lifecycle."""

    def __init__(self, nc: Client, events: _ConnectionEvents) -> None:
        self._nc = nc
        self._events = events
        self.name = events.name
        self._checked_subjects: set[str] = set()
        #: Whether this nats-py has the internals `publish_now` writes to (checked once, when first connected).
        self._fast_publish: bool | None = None

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str,
        token: str | None = None,
        user: str | None = None,
        password: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        connect_timeout_s: float = 2.0,
        reconnect_wait_s: float = 0.25,
        max_reconnect_attempts: int = -1,
        drain_timeout_s: float = 10.0,
    ) -> Bus:
        """Connect within `connect_timeout_s` (BusConnectError; BusAuthError at once if credentials are
        refused); afterwards reconnect on loss, forever by default (`max_reconnect_attempts=-1`)."""
        events = _ConnectionEvents(name, url)
        nc = Client()
        connect = asyncio.ensure_future(
            nc.connect(
                servers=url,
                name=name,
                token=token,
                user=user,
                password=password,
                tls=_tls_context(tls_ca, tls_cert, tls_key),
                connect_timeout=connect_timeout_s,  # type: ignore[arg-type]  # nats-py hints int, takes float
                reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]
                max_reconnect_attempts=max_reconnect_attempts,
                drain_timeout=drain_timeout_s,  # type: ignore[arg-type]
                error_cb=events.on_error,
                disconnected_cb=events.on_disconnected,
                reconnected_cb=events.on_reconnected,
                closed_cb=events.on_closed,
            )
        )
        done, _ = await asyncio.wait(
            {connect, events.auth_refused}, timeout=connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if connect in done and connect.exception() is None:
            events.connected = True
            return cls(nc, events)
        await _abandon(nc, connect)
        if events.auth_refused.done():
            raise BusAuthError(url, f"credentials refused ({events.auth_refused.result()})")
        if connect in done:
            raise BusConnectError(url, str(connect.exception())) from connect.exception()
        reason = f"no connection within {connect_timeout_s:g} s"
        last = events.last_error
        raise BusConnectError(url, f"{reason} (last error: {last!r})" if last else reason)

    @property
    def max_payload(self) -> int:
        """The server's max_payload in bytes (headers + payload), learned at connect."""
        return self._nc.max_payload

    @property
    def is_connected(self) -> bool:
        """Whether the connection is up right now (False while reconnecting or once closed)."""
        return self._nc.is_connected

    @property
    def num_reconnects(self) -> int:
        """How many times the connection was lost and made again."""
        return self._events.num_reconnects

    async def publish(
        self, subject: str, message: Message | bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        """Send one message; PayloadTooLarge before sending anything if it exceeds max_payload."""
        payload = encode_payload(message)
        wire_headers = outgoing_headers(headers)
        check_size(subject, payload, wire_headers, self.max_payload)
        with _translated(subject):
            await self._nc.publish(subject, payload, headers=wire_headers)

    def publish_now(self, messages: list[tuple[str, bytes]]) -> bool:
        """Send pre-encoded messages (no headers, no trace context) without a coroutine: what `publish` does for
        them, minus its coroutines and nats-py's flusher task (a Task step and one more turn of the loop each time
        the loop wakes to publish). They join nats-py's pending buffer, behind anything queued there, and go to
        the socket in one write now, or through the flusher when the socket's buffer is not empty (it waits for
        the socket to drain). False, with nothing sent: the connection is not up (reconnecting, draining,
        closed) or nats-py's pending buffer is over its limit; `publish` buffers, waits or raises then.
        PayloadTooLarge or BusError (a bad subject) before anything is queued.

        For a worker's per-step token and KV event batches, sent from a callback on the loop once per engine step.
        It uses nats-py's internals (`_pending`, `_flush_queue`, the transport; nats-py is pinned in
        constraints.txt): tests/integration/test_bus_publish_now.py checks it on a real nats-server."""
        nc = self._nc
        if self._fast_publish is None and nc.is_connected:
            self._fast_publish = supports_fast_publish(nc)
        if not self._fast_publish:
            return False  # another nats-py than the one pinned, or not connected yet: `publish` does it
        if nc._status != Client.CONNECTED or nc._flush_queue is None or nc._pending_data_size > nc._max_pending_size:
            return False
        max_payload = nc.max_payload
        checked = self._checked_subjects
        for subject, payload in messages:
            if subject not in checked:
                _check_subject(subject)
                if len(checked) >= _MAX_CHECKED_SUBJECTS:
                    checked.clear()
                checked.add(subject)
            if len(payload) > max_payload:
                raise PayloadTooLarge(subject, len(payload), max_payload)
        pending, stats = nc._pending, nc.stats
        for subject, payload in messages:
            size = len(payload)
            command = f"PUB {subject}  {size}\r\n".encode()  # nats-py's pub_cmd with no reply subject
            pending += (command, payload, _CRLF)
            nc._pending_data_size += len(command) + size + 2
            stats["out_msgs"] += 1
            stats["out_bytes"] += size
        transport = nc._transport
        socket = transport._io_writer.transport if isinstance(transport, TcpTransport) else None
        if socket is not None and not socket.get_write_buffer_size():
            socket.write(b"".join(pending))  # what nats-py's writelines comes to, minus two wrappers
            nc._pending = []
            nc._pending_data_size = 0
        elif nc._flush_queue.empty():  # let the flusher write it once the socket drains
            nc._flush_queue.put_nowait(asyncio.get_running_loop().create_future())
        return True

    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        queue: str | None = None,
        message_type: type[Message] | None = None,
    ) -> BusSubscription:
        """Deliver messages on `subject` (wildcards allowed) to `handler(message, msg)`, one at a time.

        Returns once the server has registered the interest, so a message published afterwards by any
        client reaches the handler (while reconnecting, the interest is registered on reconnect).
        """

        async def on_msg(msg: Msg) -> None:
            await dispatch(handler, msg, message_type, logger)

        with _translated(subject):
            sub = await self._nc.subscribe(subject, queue=queue or "", cb=on_msg)
        if self._nc.is_connected:
            try:
                await self._round_trip(_SUBSCRIBE_CONFIRM_TIMEOUT_S)
            except nats_errors.Error as exc:
                logger.warning("bus %s: subscription to %s not confirmed yet: %s", self.name, subject, exc)
        return BusSubscription(sub, subject, queue)

    async def request(
        self,
        subject: str,
        message: Message | bytes,
        response_type: type[M],
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> M:
        """Send and wait for one reply: NoResponders if nobody listens, BusTimeout after `timeout_s`."""
        payload = encode_payload(message)
        wire_headers = outgoing_headers(headers)
        check_size(subject, payload, wire_headers, self.max_payload)
        with _translated(subject):
            try:
                msg = await self._nc.request(subject, payload, timeout=timeout_s, headers=wire_headers)
            except nats_errors.NoRespondersError:
                raise NoResponders(subject) from None
            except nats_errors.TimeoutError:
                raise BusTimeout(subject, timeout_s) from None
        return decode(subject, msg.data, response_type)

    async def reply(
        self, msg: IncomingMsg, message: Message | bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        """Answer a request received by a handler (BusError if `msg` carries no reply subject)."""
        if not msg.reply:
            raise BusError(f"message on {msg.subject!r} has no reply subject; it was not a request")
        await self.publish(msg.reply, message, headers)

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Wait until the server has processed everything sent so far (publishes, subscriptions)."""
        with _translated("<flush>"):
            try:
                await self._round_trip(timeout_s)
            except nats_errors.TimeoutError:
                raise BusTimeout("<flush>", timeout_s) from None

    async def _round_trip(self, timeout_s: float) -> None:
        # nats-py (2.16) writes the PING of flush() straight to the socket, ahead of SUB/PUB commands still
        # queued for its flusher task, so one flush() can return before they reach the server (seen: ~5% of
        # first messages lost after subscribe). The first PONG proves the flusher has written them; the
        # second PING follows them on the wire.
        for _ in range(2):
            await self._nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # hinted int, takes float

    async def drain(self) -> None:
        """Stop all subscriptions, let handlers in progress finish, flush what was published, close."""
        if self._nc.is_closed:
            return
        self._events.closing = True
        try:
            await self._nc.drain()
        except nats_errors.Error as exc:
            logger.warning("bus %s: drain failed (%s); closing", self.name, exc)
        if not self._nc.is_closed:
            await self._nc.close()

    async def close(self) -> None:
        """Drain when connected, else close at once; safe to call twice."""
        if self._nc.is_connected:
            await self.drain()
        elif not self._nc.is_closed:
            self._events.closing = True
            await self._nc.close()


@contextlib.contextmanager
def _translated(subject: str) -> Iterator[None]:
    """Map nats-py errors to BusError types (timeouts and no-responders are mapped by the caller)."""
    try:
        yield
    except (nats_errors.ConnectionClosedError, nats_errors.ConnectionDrainingError) as exc:
        raise BusClosed(f"bus is closed; cannot use {subject!r}") from exc
    except (nats_errors.NoRespondersError, nats_errors.TimeoutError):
        raise
    except nats_errors.Error as exc:
        raise BusError(f"{subject!r}: {exc}") from exc


def _check_subject(subject: str) -> None:
    """What nats-py checks of a subject it publishes on (empty, whitespace: BusError)."""
    try:
        nats_client._validate_subject(subject)
    except nats_errors.Error as exc:
        raise BusError(f"{subject!r}: {exc}") from exc


def _is_auth_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, nats_errors.AuthorizationError) or "authorization" in text or "authentication" in text


def _tls_context(tls_ca: str | None, tls_cert: str | None, tls_key: str | None) -> ssl.SSLContext | None:
    if tls_ca is None and tls_cert is None:
        return None
    context = ssl.create_default_context(cafile=tls_ca)
    if tls_cert is not None:
        context.load_cert_chain(tls_cert, tls_key)
    return context


async def _abandon(nc: Client, connect: asyncio.Future[None]) -> None:
    """Stop a first connect that failed or hangs, and release its socket and tasks."""
    connect.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await connect
    with contextlib.suppress(Exception):
        await nc.close()


#: nats-py Client attributes `Bus.publish_now` reads or writes (nats-py 2.16, pinned in constraints.txt).
_FAST_PUBLISH_ATTRIBUTES = ("_status", "_flush_queue", "_pending", "_pending_data_size", "_max_pending_size",
                            "_transport", "stats")


def supports_fast_publish(nc: Client) -> bool:
    """Whether a connected nats-py client has the internals `Bus.publish_now` uses: a user's other nats-py
    version (pyproject allows >= 2.7) falls back to `publish`, slower but never broken."""
    if not all(hasattr(nc, name) for name in _FAST_PUBLISH_ATTRIBUTES):
        return False
    transport = nc._transport
    return (isinstance(nc._pending, list) and isinstance(nc.stats, dict) and "out_msgs" in nc.stats
            and (not isinstance(transport, TcpTransport) or hasattr(transport, "_io_writer")))
