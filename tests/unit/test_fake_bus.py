"""FakeBus behaves like the real bus where handlers can tell: routing, queue groups, errors, tracing, drain."""

from __future__ import annotations

import asyncio
import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from deepinfer.bus import (
    TRACEPARENT,
    BusClosed,
    BusError,
    BusTimeout,
    IncomingMsg,
    MessageBus,
    NoResponders,
    PayloadTooLarge,
)
from deepinfer.protocol.base import Message
from deepinfer.testing import FakeBroker, FakeBus, FakeMsg, subject_matches


class Ping(Message):
    n: int


class Pong(Message):
    n: int


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("di.m.route", "di.m.route", True),
        ("di.m.route", "di.m.routes", False),
        ("di.*.route", "di.m.route", True),
        ("di.*.route", "di.m.x.route", False),
        ("di.m.>", "di.m.tokens.gw1", True),
        ("di.m.>", "di.m", False),
        ("di.>", "di.m", True),
        ("*.*", "a.b", True),
        ("*.*", "a", False),
        ("a.b", "a", False),
    ],
)
def test_subject_matching(pattern: str, subject: str, expected: bool) -> None:
    assert subject_matches(pattern, subject) is expected


async def test_request_reply_between_clients_of_one_broker() -> None:
    broker = FakeBroker()
    server, client = FakeBus(broker, name="server"), FakeBus(broker, name="client")
    assert isinstance(server, MessageBus)

    async def double(ping: Ping, msg: IncomingMsg) -> None:
        await server.reply(msg, Pong(n=ping.n * 2))

    await server.subscribe("svc.double", double, message_type=Ping)
    reply = await client.request("svc.double", Ping(n=21), Pong, timeout_s=1.0)
    assert isinstance(reply, Pong) and reply.n == 42
    assert [m.subject for m in broker.published][0] == "svc.double"


async def test_order_wildcards_and_settle() -> None:
    bus = FakeBus()
    exact: list[int] = []
    wild: list[str] = []

    async def collect_exact(ping: Ping, msg: IncomingMsg) -> None:
        exact.append(ping.n)

    async def collect_wild(data: bytes, msg: IncomingMsg) -> None:
        wild.append(msg.subject)

    await bus.subscribe("tokens.gw1", collect_exact, message_type=Ping)
    await bus.subscribe("tokens.>", collect_wild)
    for n in range(50):
        await bus.publish("tokens.gw1", Ping(n=n))
    await bus.publish("tokens.gw2", Ping(n=0))
    assert exact == []  # delivery is asynchronous, as on NATS
    await bus.broker.settle()
    assert exact == list(range(50))
    assert wild == ["tokens.gw1"] * 50 + ["tokens.gw2"]


async def test_queue_group_delivers_each_message_once() -> None:
    bus = FakeBus()
    got: dict[str, list[int]] = {"a": [], "b": [], "plain": []}

    def collector(name: str):
        async def collect(ping: Ping, msg: IncomingMsg) -> None:
            got[name].append(ping.n)

        return collect

    await bus.subscribe("route", collector("a"), queue="scheduler", message_type=Ping)
    await bus.subscribe("route", collector("b"), queue="scheduler", message_type=Ping)
    await bus.subscribe("route", collector("plain"), message_type=Ping)
    for n in range(10):
        await bus.publish("route", Ping(n=n))
    await bus.broker.settle()
    assert sorted(got["a"] + got["b"]) == list(range(10))
    assert got["a"] and got["b"]
    assert got["plain"] == list(range(10))


async def test_errors_match_the_real_bus() -> None:
    bus = FakeBus(FakeBroker(max_payload=1024))
    with pytest.raises(NoResponders, match="nobody"):
        await bus.request("nobody", Ping(n=1), Pong, timeout_s=1.0)

    async def silent(ping: Ping, msg: IncomingMsg) -> None:
        return None

    await bus.subscribe("silent", silent, message_type=Ping)
    with pytest.raises(BusTimeout, match="silent"):
        await bus.request("silent", Ping(n=1), Pong, timeout_s=0.05)
    with pytest.raises(PayloadTooLarge) as caught:
        await bus.publish("silent", b"x" * 1025)
    assert (caught.value.size_bytes, caught.value.max_bytes) == (1025, 1024)
    with pytest.raises(BusError):
        await bus.publish("bad.*", b"")
    with pytest.raises(BusError):
        await bus.reply(FakeMsg(subject="silent", data=b""), Pong(n=1))  # not a request: no reply subject
    assert [m.subject for m in bus.published].count("silent") == 1  # the large one was never routed


async def test_failing_handler_is_logged_and_subscription_lives(caplog: pytest.LogCaptureFixture) -> None:
    bus = FakeBus()
    received: list[int] = []

    async def fragile(ping: Ping, msg: IncomingMsg) -> None:
        if ping.n == 1:
            raise RuntimeError("boom")
        received.append(ping.n)

    await bus.subscribe("work", fragile, message_type=Ping)
    for payload in (Ping(n=0), Ping(n=1), b"\xc1", Ping(n=2)):
        await bus.publish("work", payload)
    await bus.broker.settle()
    assert received == [0, 2]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("fragile" in m and "work" in m for m in errors)
    assert any("undecodable" in m and "work" in m for m in errors)


async def test_trace_context_reaches_handler() -> None:
    tracer = TracerProvider().get_tracer("test")
    bus = FakeBus()
    seen: list[tuple[int, str | None]] = []

    async def traced(data: bytes, msg: IncomingMsg) -> None:
        seen.append((trace.get_current_span().get_span_context().trace_id, (msg.headers or {}).get(TRACEPARENT)))

    await bus.subscribe("t", traced)
    with tracer.start_as_current_span("send") as span:
        trace_id = span.get_span_context().trace_id
        await bus.publish("t", b"")
    await bus.broker.settle()
    assert seen[0][0] == trace_id
    assert seen[0][1] is not None and f"{trace_id:032x}" in seen[0][1]


async def test_drain_finishes_queued_work_then_closes() -> None:
    bus = FakeBus()
    finished: list[int] = []

    async def slow(ping: Ping, msg: IncomingMsg) -> None:
        await asyncio.sleep(0.01)
        finished.append(ping.n)

    sub = await bus.subscribe("slow", slow, message_type=Ping)
    for n in range(3):
        await bus.publish("slow", Ping(n=n))
    await bus.close()
    assert finished == [0, 1, 2]
    with pytest.raises(BusClosed):
        await bus.publish("slow", Ping(n=3))
    await bus.close()
    await sub.unsubscribe()  # idempotent after close
