"""The message bus (NATS control plane): typed publish/subscribe/request with trace context and size checks.

`Bus` talks to a real nats-server; `deepinfer.testing.FakeBus` is the in-memory double. Both satisfy
`MessageBus`. See docs/bus.md.
"""

from deepinfer.bus.envelope import TRACEPARENT, TRACESTATE
from deepinfer.bus.errors import (
    BusAuthError,
    BusClosed,
    BusConnectError,
    BusError,
    BusTimeout,
    MessageDecodeError,
    NoResponders,
    PayloadTooLarge,
)
from deepinfer.bus.interface import Handler, IncomingMsg, MessageBus, Subscription
from deepinfer.bus.nats_bus import Bus, BusSubscription
from deepinfer.bus.subscriptions import Subscriptions

__all__ = [
    "TRACEPARENT",
    "TRACESTATE",
    "Bus",
    "BusAuthError",
    "BusClosed",
    "BusConnectError",
    "BusError",
    "BusSubscription",
    "BusTimeout",
    "Handler",
    "IncomingMsg",
    "MessageBus",
    "MessageDecodeError",
    "NoResponders",
    "PayloadTooLarge",
    "Subscription",
    "Subscriptions",
]
