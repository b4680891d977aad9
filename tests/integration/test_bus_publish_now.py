"""`Bus.publish_now` (pre-encoded messages without a coroutine) against a real nats-server: the bytes arrive as
sent, in order with `publish`, through the flusher when the socket is full; bad input sends nothing."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from deepinfer.bus import Bus, BusError, IncomingMsg, PayloadTooLarge
from deepinfer.bus.nats_bus import supports_fast_publish
from deepinfer.nats_server import NatsServer

pytestmark = pytest.mark.integration


def unique_subject(name: str) -> str:
    return f"test.{name}.{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def publisher(nats_server: NatsServer) -> AsyncIterator[Bus]:
    second = await Bus.connect(nats_server.url, name="publisher", token=nats_server.token)
    yield second
    await second.close()


async def _collect(bus: Bus, subject: str) -> list[bytes]:
    received: list[bytes] = []

    async def on_msg(data: bytes, msg: IncomingMsg) -> None:
        assert msg.headers is None
        received.append(data)

    await bus.subscribe(subject, on_msg)
    return received


async def _wait_for(received: list[bytes], count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(received) < count:
        assert time.monotonic() < deadline, f"{len(received)} of {count} messages within {timeout_s} s"
        await asyncio.sleep(0.005)


async def test_mixed_with_publish_in_order(bus: Bus, publisher: Bus) -> None:
    subject, other = unique_subject("now"), unique_subject("now-other")
    received, received_other = await _collect(bus, subject), await _collect(bus, other)
    expected = []
    for n in range(300):
        if n % 3 == 0:
            await publisher.publish(subject, b"async %d" % n)
            expected.append(b"async %d" % n)
        else:
            assert publisher.publish_now([(subject, b"now %d" % n), (other, b"other %d" % n), (subject, b"")])
            expected += [b"now %d" % n, b""]
    await _wait_for(received, len(expected))
    await _wait_for(received_other, 200)
    assert received == expected
    assert received_other == [b"other %d" % n for n in range(300) if n % 3]


async def test_a_full_socket_goes_through_the_flusher(bus: Bus, publisher: Bus) -> None:
    # 64 MiB at once: the socket's buffer fills, so the rest waits for nats-py's flusher; past nats-py's pending
    # limit publish_now refuses (False) and `publish` waits for the flush, as it does for any message.
    subject = unique_subject("now-big")
    received = await _collect(bus, subject)
    payloads = [bytes([n]) * (512 << 10) for n in range(128)]
    refused = 0
    for payload in payloads:
        if not publisher.publish_now([(subject, payload)]):
            refused += 1
            await publisher.publish(subject, payload)
    await _wait_for(received, len(payloads), timeout_s=30.0)
    assert received == payloads
    assert 0 < refused < len(payloads)


async def test_bad_input_sends_nothing(bus: Bus, publisher: Bus) -> None:
    subject = unique_subject("now-bad")
    received = await _collect(bus, subject)
    too_large = b"x" * (publisher.max_payload + 1)
    with pytest.raises(PayloadTooLarge):
        publisher.publish_now([(subject, b"first"), (subject, too_large)])
    with pytest.raises(BusError):
        publisher.publish_now([(subject, b"first"), ("bad subject", b"x")])
    assert publisher.publish_now([(subject, b"last")])
    await _wait_for(received, 1)
    await publisher.flush()
    await asyncio.sleep(0.05)
    assert received == [b"last"]


async def test_false_once_closed(nats_server: NatsServer) -> None:
    closing = await Bus.connect(nats_server.url, name="closing", token=nats_server.token)
    await closing.close()
    assert closing.publish_now([(unique_subject("now-closed"), b"x")]) is False


async def test_false_while_the_server_is_down_then_sent_again() -> None:
    with NatsServer() as server:
        receiver = await Bus.connect(server.url, name="receiver", token=server.token, reconnect_wait_s=0.05)
        sender = await Bus.connect(server.url, name="sender", token=server.token, reconnect_wait_s=0.05)
        try:
            received = await _collect(receiver, "now.restart")
            assert sender.publish_now([("now.restart", b"1")])
            await _wait_for(received, 1)
            await asyncio.to_thread(server.stop)
            deadline = time.monotonic() + 5
            while sender.is_connected:
                assert time.monotonic() < deadline, "the sender did not see the server go"
                await asyncio.sleep(0.01)
            assert sender.publish_now([("now.restart", b"lost")]) is False  # the caller publishes (buffered)
            await asyncio.to_thread(server.start)
            deadline = time.monotonic() + 10
            while sender.num_reconnects < 1 or receiver.num_reconnects < 1:
                assert time.monotonic() < deadline, "no reconnect"
                await asyncio.sleep(0.01)
            await receiver.flush()  # its subscription is registered again
            assert sender.publish_now([("now.restart", b"2")])
            await _wait_for(received, 2)
            assert received == [b"1", b"2"]
        finally:
            await receiver.close()
            await sender.close()


async def test_another_nats_py_falls_back_to_publish(bus: Bus, publisher: Bus) -> None:
    """A nats-py without the internals publish_now writes to (pyproject allows other versions): it refuses, and
    the caller's `publish` sends; the connected client of the pinned version has them."""
    assert supports_fast_publish(publisher._nc)
    subject = unique_subject("fallback")
    received = await _collect(bus, subject)
    await bus.flush()
    del publisher._nc._pending_data_size  # as a nats-py that renamed it would look
    publisher._fast_publish = None
    assert publisher.publish_now([(subject, b"x")]) is False
    publisher._nc._pending_data_size = 0
    await publisher.publish(subject, b"y")
    await _wait_for(received, 1)
    assert received == [b"y"]
