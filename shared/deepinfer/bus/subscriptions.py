"""A service's subscriptions held by name, so one can be dropped (stop taking prefills while draining)
without depending on the order they were made in."""

from __future__ import annotations

import contextlib
import logging

from deepinfer.bus.interface import Handler, MessageBus, Subscription
from deepinfer.protocol.base import Message

log = logging.getLogger(__name__)


class Subscriptions:
    """Named subscriptions on one bus: `subscribe(name, ...)`, `unsubscribe(name)`, `close()`."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self._by_name: dict[str, Subscription] = {}

    async def subscribe(
        self,
        name: str,
        subject: str,
        handler: Handler,
        queue: str | None = None,
        message_type: type[Message] | None = None,
    ) -> Subscription:
        """Subscribe and keep the subscription under `name` (a name is used once)."""
        if name in self._by_name:
            raise ValueError(f"a subscription named {name!r} already exists")
        subscription = await self.bus.subscribe(subject, handler, queue=queue, message_type=message_type)
        self._by_name[name] = subscription
        return subscription

    async def unsubscribe(self, name: str) -> None:
        """Stop the subscription `name` (no-op when absent); a closed bus is not an error here."""
        subscription = self._by_name.pop(name, None)
        if subscription is None:
            return
        with contextlib.suppress(Exception):  # the bus may be closed or draining already
            await subscription.unsubscribe()

    async def close(self) -> None:
        """Stop every subscription (idempotent)."""
        for name in list(self._by_name):
            await self.unsubscribe(name)
