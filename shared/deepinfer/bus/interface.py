"""The bus interface that handlers are written against; `Bus` (NATS) and `FakeBus` (memory) implement it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

from deepinfer.protocol.base import Message

M = TypeVar("M", bound=Message)


class IncomingMsg(Protocol):
    """What a handler sees of a received message (a nats-py `Msg` satisfies it)."""

    @property
    def subject(self) -> str: ...

    @property
    def reply(self) -> str: ...

    @property
    def data(self) -> bytes: ...

    @property
    def headers(self) -> dict[str, str] | None: ...


#: `handler(message, msg)`: `message` is the decoded Message when the subscription has a message_type,
#: else the raw payload bytes; `msg` carries subject, reply subject and headers.
Handler = Callable[[Any, IncomingMsg], Awaitable[None]]


class Subscription(Protocol):
    """Interest in a subject; `unsubscribe()` stops delivery (messages already queued are dropped)."""

    @property
    def subject(self) -> str: ...

    @property
    def queue(self) -> str | None: ...

    async def unsubscribe(self) -> None: ...


@runtime_checkable
class MessageBus(Protocol):
    """Publish/subscribe/request over subjects.

    Lifecycle: connect (`await Bus.connect(...)` or `FakeBus()`) → subscribe / publish / request → on shutdown
    `await bus.drain()` (stop taking messages, let handlers in progress finish, flush, close). `close()` is
    idempotent and drains when it still can. Handlers of one subscription run one at a time, in arrival order;
    an exception in a handler, or a payload that does not decode, is logged and the subscription lives on.
    """

    @property
    def max_payload(self) -> int: ...

    async def publish(
        self, subject: str, message: Message | bytes, headers: Mapping[str, str] | None = None
    ) -> None: ...

    def publish_now(self, messages: list[tuple[str, bytes]]) -> bool:
        """Send pre-encoded messages (subject, bytes; no headers) without a coroutine; False, nothing sent, when
        the connection is not up (then `publish`, which buffers or raises)."""
        ...

    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        queue: str | None = None,
        message_type: type[Message] | None = None,
    ) -> Subscription: ...

    async def request(
        self,
        subject: str,
        message: Message | bytes,
        response_type: type[M],
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> M: ...

    async def reply(
        self, msg: IncomingMsg, message: Message | bytes, headers: Mapping[str, str] | None = None
    ) -> None: ...

    async def drain(self) -> None: ...

    async def close(self) -> None: ...
