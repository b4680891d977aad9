"""deepinfer.bus against a real nats-server: round trips, ordering, errors, tracing, reconnect, drain."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from deepinfer.bus import (
    TRACEPARENT,
    Bus,
    BusAuthError,
    BusClosed,
    BusTimeout,
    IncomingMsg,
    MessageBus,
    NoResponders,
    PayloadTooLarge,
)
from deepinfer.bus.envelope import header_size_bytes
from deepinfer.nats_server import NatsServer
from deepinfer.protocol.base import Message

pytestmark = pytest.mark.integration


class Ping(Message):
    n: int


class Pong(Message):
    n: int


class Blob(Message):
    data: bytes


def unique_subject(name: str) -> str:
    """A subject no other test uses (the session's server is shared)."""
    return f"test.{name}.{uuid.uuid4().hex[:8]}"


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll until `predicate()` holds; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.005)


async def connect(server: NatsServer, name: str) -> Bus:
    return await Bus.connect(server.url, name=name, token=server.token, reconnect_wait_s=0.05)


@pytest.fixture
async def publisher(nats_server: NatsServer) -> AsyncIterator[Bus]:
    """A second connection, so that senders and receivers are different clients."""
    second = await connect(nats_server, "publisher")
    yield second
    await second.close()


async def test_request_reply_round_trip(bus: Bus, publisher: Bus) -> None:
    assert isinstance(bus, MessageBus)
    subject = unique_subject("rr")

    async def double(ping: Ping, msg: IncomingMsg) -> None:
        await bus.reply(msg, Pong(n=ping.n * 2))

    await bus.subscribe(subject, double, message_type=Ping)
    replies = [await publisher.request(subject, Ping(n=n), Pong, timeout_s=2.0) for n in (1, 21)]
    assert [type(r) for r in replies] == [Pong, Pong]
    assert [r.n for r in replies] == [2, 42]


async def test_thousand_messages_arrive_in_order(bus: Bus, publisher: Bus) -> None:
    subject = unique_subject("order")
    received: list[int] = []

    async def collect(ping: Ping, msg: IncomingMsg) -> None:
        received.append(ping.n)

    await bus.subscribe(subject, collect, message_type=Ping)
    for n in range(1000):
        await publisher.publish(subject, Ping(n=n))
    await wait_until(lambda: len(received) >= 1000)
    assert received == list(range(1000))


async def test_request_without_responder_raises_no_responders(bus: Bus) -> None:
    subject = unique_subject("nobody")
    started = time.monotonic()
    with pytest.raises(NoResponders, match=subject):
        await bus.request(subject, Ping(n=1), Pong, timeout_s=60.0)
    assert time.monotonic() - started < 30.0  # the server answers at once: not the 60 s timeout, however loaded


async def test_slow_responder_raises_bus_timeout(bus: Bus, publisher: Bus) -> None:
    subject = unique_subject("slow")
    release = asyncio.Event()

    async def slow(ping: Ping, msg: IncomingMsg) -> None:
        await asyncio.wait_for(release.wait(), timeout=60.0)

    await bus.subscribe(subject, slow, message_type=Ping)
    started = time.monotonic()
    with pytest.raises(BusTimeout, match=subject) as caught:
        await publisher.request(subject, Ping(n=1), Pong, timeout_s=0.2)
    elapsed = time.monotonic() - started
    release.set()
    assert isinstance(caught.value, TimeoutError)
    assert 0.2 <= elapsed < 30.0  # never before its 0.2 s; the responder's 60 s never waited for


async def test_trace_context_reaches_handler(bus: Bus, publisher: Bus) -> None:
    tracer = TracerProvider().get_tracer("test")
    subject = unique_subject("trace")
    seen: dict[str, object] = {}

    async def traced(ping: Ping, msg: IncomingMsg) -> None:
        seen["traceparent"] = (msg.headers or {}).get(TRACEPARENT)
        seen["current"] = trace.get_current_span().get_span_context()
        with tracer.start_as_current_span("handle") as child:
            seen["child_parent"] = child.parent

    await bus.subscribe(subject, traced, message_type=Ping)
    with tracer.start_as_current_span("send") as span:
        sender = span.get_span_context()
        await publisher.publish(subject, Ping(n=1))
    await wait_until(lambda: "child_parent" in seen)

    assert seen["traceparent"] == f"00-{sender.trace_id:032x}-{sender.span_id:016x}-{sender.trace_flags:02x}"
    current = seen["current"]
    assert isinstance(current, trace.SpanContext)
    assert (current.trace_id, current.span_id, current.is_remote) == (sender.trace_id, sender.span_id, True)
    parent = seen["child_parent"]
    assert isinstance(parent, trace.SpanContext)
    assert (parent.trace_id, parent.span_id) == (sender.trace_id, sender.span_id)


async def test_wrong_token_is_refused(nats_server: NatsServer) -> None:
    started = time.monotonic()
    with pytest.raises(BusAuthError, match=nats_server.url):
        await Bus.connect(nats_server.url, name="intruder", token="not-the-token", connect_timeout_s=60.0)
    with pytest.raises(BusAuthError):
        await Bus.connect(nats_server.url, name="anonymous", connect_timeout_s=60.0)
    assert time.monotonic() - started < 30.0  # refused at once, not retried until the 60 s timeout


async def test_subscriber_survives_server_restart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="deepinfer.bus")
    with NatsServer() as server:
        receiver, sender = await connect(server, "receiver"), await connect(server, "sender")
        try:
            received: list[int] = []

            async def collect(ping: Ping, msg: IncomingMsg) -> None:
                received.append(ping.n)

            await receiver.subscribe("restart.test", collect, message_type=Ping)
            await sender.publish("restart.test", Ping(n=1))
            await wait_until(lambda: received == [1])

            await asyncio.to_thread(server.restart)
            await wait_until(lambda: receiver.num_reconnects == 1 and sender.num_reconnects == 1)
            await sender.publish("restart.test", Ping(n=2))
            await wait_until(lambda: received == [1, 2])
        finally:
            await receiver.close()
            await sender.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("bus receiver: disconnected" in m for m in messages)
    assert any("bus receiver: reconnected" in m for m in messages)


async def test_payload_too_large_is_never_sent() -> None:
    with NatsServer(max_payload=64 * 1024) as server:
        receiver, sender = await connect(server, "receiver"), await connect(server, "sender")
        try:
            assert sender.max_payload == 64 * 1024
            received: list[bytes] = []

            async def collect(data: bytes, msg: IncomingMsg) -> None:
                received.append(data)

            await receiver.subscribe("big", collect)
            with pytest.raises(PayloadTooLarge) as caught:
                await sender.publish("big", Blob(data=b"x" * 100 * 1024))
            assert caught.value.subject == "big"
            assert caught.value.size_bytes > 100 * 1024
            assert caught.value.max_bytes == 64 * 1024

            # Headers count: the server accepts exactly max_payload bytes of headers + payload, not one more.
            headers = {"x-test": "1"}
            exact = b"y" * (64 * 1024 - header_size_bytes(headers))
            with pytest.raises(PayloadTooLarge):
                await sender.publish("big", exact + b"y", headers=headers)
            await sender.publish("big", exact, headers=headers)
            await sender.publish("big", b"marker")
            await wait_until(lambda: len(received) >= 2)
            await asyncio.sleep(0.05)  # anything sent before the marker has arrived; give strays a moment
            assert received == [exact, b"marker"]
            assert sender.is_connected  # a violation would have made the server drop us
        finally:
            await receiver.close()
            await sender.close()


async def test_queue_group_delivers_each_message_once(nats_server: NatsServer, publisher: Bus) -> None:
    subject = unique_subject("queue")
    workers = [await connect(nats_server, f"worker-{i}") for i in range(2)]
    received: list[list[int]] = [[], []]
    try:
        for worker, inbox in zip(workers, received, strict=True):

            async def collect(ping: Ping, msg: IncomingMsg, inbox: list[int] = inbox) -> None:
                inbox.append(ping.n)

            await worker.subscribe(subject, collect, queue="workers", message_type=Ping)
        for n in range(200):
            await publisher.publish(subject, Ping(n=n))
        await wait_until(lambda: len(received[0]) + len(received[1]) >= 200)
        await asyncio.sleep(0.05)  # a duplicate would arrive now
        assert sorted(received[0] + received[1]) == list(range(200))
        assert received[0] and received[1]  # both members got a share
    finally:
        for worker in workers:
            await worker.close()


async def test_failing_handler_keeps_subscription(
    bus: Bus, publisher: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    subject = unique_subject("failing")
    received: list[int] = []

    async def fragile(ping: Ping, msg: IncomingMsg) -> None:
        if ping.n == 1:
            raise RuntimeError("handler bug")
        received.append(ping.n)

    await bus.subscribe(subject, fragile, message_type=Ping)
    await publisher.publish(subject, Ping(n=0))
    await publisher.publish(subject, Ping(n=1))
    await publisher.publish(subject, b"\xc1 is not msgpack")
    await publisher.publish(subject, Blob(data=b"no n field"))
    await publisher.publish(subject, Ping(n=4))
    await wait_until(lambda: received[-1:] == [4])
    assert received == [0, 4]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("fragile" in r.getMessage() and subject in r.getMessage() for r in errors)
    assert any("undecodable" in r.getMessage() and subject in r.getMessage() for r in errors)


async def test_unsubscribe_stops_delivery(bus: Bus, publisher: Bus) -> None:
    subject = unique_subject("unsub")
    received: list[int] = []

    async def collect(ping: Ping, msg: IncomingMsg) -> None:
        received.append(ping.n)

    subscription = await bus.subscribe(subject, collect, message_type=Ping)
    await publisher.publish(subject, Ping(n=1))
    await wait_until(lambda: received == [1])
    await subscription.unsubscribe()
    await bus.flush()
    await publisher.publish(subject, Ping(n=2))
    await publisher.flush()
    await bus.flush()
    assert received == [1]


async def test_close_drains_handlers_in_progress(nats_server: NatsServer, publisher: Bus) -> None:
    subject = unique_subject("drain")
    receiver = await connect(nats_server, "receiver")
    finished: list[int] = []

    async def slow(ping: Ping, msg: IncomingMsg) -> None:
        await asyncio.sleep(0.05)
        finished.append(ping.n)

    await receiver.subscribe(subject, slow, message_type=Ping)
    for n in range(4):
        await publisher.publish(subject, Ping(n=n))
    await publisher.flush()
    await wait_until(lambda: len(finished) >= 1)
    await receiver.close()
    assert finished == [0, 1, 2, 3]  # queued messages were handled before the connection closed
    with pytest.raises(BusClosed):
        await receiver.publish(subject, Ping(n=9))
    await receiver.close()  # idempotent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_private_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A test run or service killed with SIGKILL takes its nats-server along (no orphan holding a port)."""
    script = (
        "import sys, time\n"
        "from deepinfer.nats_server import NatsServer\n"
        "server = NatsServer(); server.start()\n"
        "print(server._process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
        os.kill(server_pid, 0)  # running
    finally:
        parent.kill()
        parent.wait(10)
    deadline = time.monotonic() + 10
    while not _gone(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _gone(server_pid):
        os.kill(server_pid, signal.SIGKILL)
        raise AssertionError("nats-server outlived the process that started it")


def _gone(pid: int) -> bool:
    """No such process, or a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
