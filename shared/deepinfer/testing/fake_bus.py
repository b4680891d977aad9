"""`FakeBus`: an in-memory MessageBus for unit tests of handlers (no server, same behaviour and errors).

    broker = FakeBroker()                       # the "server"; optional, one per FakeBus by default
    scheduler_bus, gateway_bus = FakeBus(broker), FakeBus(broker)
    await scheduler_bus.subscribe("di.m.route", on_route, queue="scheduler", message_type=RouteRequest)
    decision = await gateway_bus.request("di.m.route", req, RouteDecision, timeout_s=1.0)
    await broker.settle()                       # every queued message handled (handlers may publish more)

Delivery is asynchronous, as on NATS: publish returns before handlers run. Subjects support `*` (one token)
and `>` (one or more trailing tokens); a queue group gets each message once (round robin among members).
Trace context rides in headers and payloads over `max_payload` raise PayloadTooLarge, as on the real bus.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from deepinfer.bus.envelope import check_size, decode, dispatch, encode_payload, outgoing_headers
from deepinfer.bus.errors import BusClosed, BusError, BusTimeout, NoResponders
from deepinfer.bus.interface import Handler, IncomingMsg, M
from deepinfer.protocol.base import Message

logger = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default


@dataclass(frozen=True)
class FakeMsg:
    """A message as a FakeBus handler receives it (the fields of a nats-py Msg that handlers use)."""

    subject: str
    data: bytes
    reply: str = ""
    headers: dict[str, str] | None = None


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` matches one token, a trailing `>` matches one or more tokens."""
    pattern_tokens = pattern.split(".")
    subject_tokens = subject.split(".")
    for i, token in enumerate(pattern_tokens):
        if token == ">":
            return len(subject_tokens) > i
        if i >= len(subject_tokens) or (token != "*" and token != subject_tokens[i]):
            return False
    return len(pattern_tokens) == len(subject_tokens)


def validate_subject(subject: str, *, wildcards: bool) -> None:
    """BusError for an empty token, whitespace, or (when not allowed) a wildcard, as nats-py refuses them."""
    tokens = subject.split(".")
    bad = not subject or any(not t or any(c.isspace() for c in t) for t in tokens)
    if not bad and wildcards:
        bad = any(">" in t and (t != ">" or i != len(tokens) - 1) for i, t in enumerate(tokens))
    if not bad and not wildcards:
        bad = any(t in ("*", ">") for t in tokens)
    if bad:
        raise BusError(f"invalid subject {subject!r}")


class FakeSubscription:
    """One subscription on a FakeBroker; its handler runs in its own task, one message at a time."""

    def __init__(
        self,
        broker: FakeBroker,
        subject: str,
        queue: str | None,
        handler: Handler,
        message_type: type[Message] | None,
    ) -> None:
        self.subject = subject
        self.queue = queue
        self._broker = broker
        self._handler = handler
        self._message_type = message_type
        self._pending: asyncio.Queue[FakeMsg] = asyncio.Queue()
        self._num_unhandled = 0
        self._task = asyncio.get_running_loop().create_task(self._run())

    def deliver(self, msg: FakeMsg) -> None:
        """Queue a message for the handler."""
        self._num_unhandled += 1
        self._pending.put_nowait(msg)

    async def _run(self) -> None:
        while True:
            msg = await self._pending.get()
            try:
                await dispatch(self._handler, msg, self._message_type, logger)
            except Exception:  # dispatch logs handler errors itself; like nats-py, never let the loop die
                logger.exception("subscription to %s: delivery failed", self.subject)
            finally:
                self._num_unhandled -= 1
                self._pending.task_done()

    async def settle(self) -> None:
        """Wait until every queued message has been handled."""
        await self._pending.join()

    @property
    def idle(self) -> bool:
        """No message queued or in a handler."""
        return self._num_unhandled == 0

    async def unsubscribe(self) -> None:
        """Stop delivery now; queued messages are dropped. Idempotent."""
        self._broker.remove(self)
        self._task.cancel()

    async def drain(self) -> None:
        """Stop delivery, then let queued messages be handled."""
        self._broker.remove(self)
        await self.settle()
        self._task.cancel()


class FakeBroker:
    """The in-memory server that FakeBus clients share: routes messages, records what was published."""

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        #: Every message routed, in order (for assertions: subjects, decoded payloads, headers).
        self.published: list[FakeMsg] = []
        self._subs: list[FakeSubscription] = []
        self._queue_turns: dict[str, itertools.count[int]] = {}

    def add(self, sub: FakeSubscription) -> None:
        """Register a subscription."""
        self._subs.append(sub)

    def remove(self, sub: FakeSubscription) -> None:
        """Forget a subscription (no-op if already gone)."""
        if sub in self._subs:
            self._subs.remove(sub)

    def has_interest(self, subject: str) -> bool:
        """Whether any subscription would receive a message on `subject`."""
        return any(subject_matches(sub.subject, subject) for sub in self._subs)

    def route(self, msg: FakeMsg) -> None:
        """Deliver to every plain subscriber and to one member of each queue group."""
        self.published.append(msg)
        groups: dict[str, list[FakeSubscription]] = {}
        for sub in self._subs:
            if not subject_matches(sub.subject, msg.subject):
                continue
            if sub.queue:
                groups.setdefault(sub.queue, []).append(sub)
            else:
                sub.deliver(msg)
        for queue, members in groups.items():
            turn = next(self._queue_turns.setdefault(queue, itertools.count()))
            members[turn % len(members)].deliver(msg)

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Wait until no subscription has work left (handlers that publish start more work; loop).

        TimeoutError naming the busy subjects after `timeout_s` (a handler that never returns).
        """
        try:
            async with asyncio.timeout(timeout_s):
                while busy := [sub for sub in self._subs if not sub.idle]:
                    await asyncio.gather(*(sub.settle() for sub in busy))
        except TimeoutError:
            busy_subjects = sorted({sub.subject for sub in self._subs if not sub.idle})
            raise TimeoutError(f"handlers still busy after {timeout_s:g} s on {busy_subjects}") from None


class FakeBus:
    """A MessageBus client on a FakeBroker (a private one unless given); see the module docstring."""

    def __init__(self, broker: FakeBroker | None = None, name: str = "fake") -> None:
        self.broker = broker if broker is not None else FakeBroker()
        self.name = name
        self._subs: list[FakeSubscription] = []
        self._inbox_ids = itertools.count()
        self._closed = False

    @property
    def max_payload(self) -> int:
        """The broker's max_payload in bytes (headers + payload)."""
        return self.broker.max_payload

    @property
    def published(self) -> list[FakeMsg]:
        """Every message the broker routed, from any client, in order."""
        return self.broker.published

    async def publish(
        self, subject: str, message: Message | bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        """Route one message; PayloadTooLarge (nothing sent) when over max_payload."""
        await self._send(subject, message, headers, reply="")

    def publish_now(self, messages: list[tuple[str, bytes]]) -> bool:
        """Route pre-encoded messages at once (no headers); False, nothing routed, once closed."""
        if self._closed:
            return False
        for subject, payload in messages:
            validate_subject(subject, wildcards=False)
            check_size(subject, payload, None, self.max_payload)
        for subject, payload in messages:
            self.broker.route(FakeMsg(subject=subject, data=payload, reply="", headers=None))
        return True

    async def _send(
        self, subject: str, message: Message | bytes, headers: Mapping[str, str] | None, reply: str
    ) -> None:
        if self._closed:
            raise BusClosed(f"bus is closed; cannot use {subject!r}")
        validate_subject(subject, wildcards=False)
        payload = encode_payload(message)
        wire_headers = outgoing_headers(headers)
        check_size(subject, payload, wire_headers, self.max_payload)
        self.broker.route(FakeMsg(subject=subject, data=payload, reply=reply, headers=wire_headers))

    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        queue: str | None = None,
        message_type: type[Message] | None = None,
    ) -> FakeSubscription:
        """Deliver messages on `subject` (wildcards allowed) to `handler(message, msg)`, one at a time."""
        if self._closed:
            raise BusClosed(f"bus is closed; cannot use {subject!r}")
        validate_subject(subject, wildcards=True)
        sub = FakeSubscription(self.broker, subject, queue, handler, message_type)
        self.broker.add(sub)
        self._subs.append(sub)
        return sub

    async def request(
        self,
        subject: str,
        message: Message | bytes,
        response_type: type[M],
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> M:
        """Send and wait for one reply: NoResponders if nobody listens, BusTimeout after `timeout_s`."""
        if self._closed:
            raise BusClosed(f"bus is closed; cannot use {subject!r}")
        if not self.broker.has_interest(subject):
            raise NoResponders(subject)
        inbox = f"_INBOX.{self.name}.{next(self._inbox_ids)}"
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_reply(data: bytes, msg: IncomingMsg) -> None:
            if not answer.done():
                answer.set_result(data)

        sub = await self.subscribe(inbox, on_reply)
        try:
            await self._send(subject, message, headers, reply=inbox)
            data = await asyncio.wait_for(answer, timeout_s)
        except TimeoutError:
            raise BusTimeout(subject, timeout_s) from None
        finally:
            await sub.unsubscribe()
        return decode(subject, data, response_type)

    async def reply(
        self, msg: IncomingMsg, message: Message | bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        """Answer a request received by a handler (BusError if `msg` carries no reply subject)."""
        if not msg.reply:
            raise BusError(f"message on {msg.subject!r} has no reply subject; it was not a request")
        await self.publish(msg.reply, message, headers)

    async def drain(self) -> None:
        """Stop this client's subscriptions, let queued messages be handled, then close."""
        if self._closed:
            return
        await asyncio.gather(*(sub.drain() for sub in self._subs))
        self._subs.clear()
        self._closed = True

    async def close(self) -> None:
        """Drain; safe to call twice."""
        await self.drain()
