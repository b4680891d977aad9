"""`Outbox`: a worker's replies of one turn of the loop go to the socket in one write (or with the next step's
batches, ahead of them), and whatever cannot go that way goes through `publish`/`reply` as before."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from deepinfer.bus import BusError
from deepinfer.protocol import DecodeAccepted, DecodeStatus
from deepinfer.tasks import BackgroundTasks
from deepinfer.worker.outbox import Outbox


@dataclass
class Msg:
    subject: str = "decode.m.w"
    reply: str = "_INBOX.a"
    data: bytes = b""
    headers: dict[str, str] | None = None


class Recorder:
    """A bus recording each publish_now (one socket write) and each publish."""

    max_payload = 1024

    def __init__(self, connected: bool = True) -> None:
        self.connected = connected
        self.writes: list[list[tuple[str, bytes]]] = []
        self.published: list[tuple[str, bytes]] = []

    def publish_now(self, messages: list[tuple[str, bytes]]) -> bool:
        if any(" " in subject for subject, _ in messages):
            raise BusError("bad subject")
        if self.connected:
            self.writes.append(list(messages))
        return self.connected

    async def publish(self, subject: str, payload: bytes) -> None:
        if " " in subject:
            raise BusError("bad subject")
        self.published.append((subject, payload))


def accepted(request_id: str) -> DecodeAccepted:
    return DecodeAccepted(request_id=request_id, status=DecodeStatus.ACCEPTED)


async def test_replies_of_one_turn_go_in_one_write():
    bus = Recorder()
    outbox = Outbox(bus, BackgroundTasks("t"))  # type: ignore[arg-type]
    for i in range(3):
        assert outbox.reply_soon(Msg(reply=f"_INBOX.{i}"), accepted(f"r{i}"))
    assert bus.writes == []  # queued, not written yet
    await asyncio.sleep(0)
    assert bus.writes == [[(f"_INBOX.{i}", accepted(f"r{i}").to_bytes()) for i in range(3)]]
    await asyncio.sleep(0)
    assert len(bus.writes) == 1  # nothing left to send


async def test_queued_replies_go_ahead_of_a_steps_batches_in_its_write():
    bus = Recorder()
    outbox = Outbox(bus, BackgroundTasks("t"))  # type: ignore[arg-type]
    assert outbox.reply_soon(Msg(), accepted("r0"))
    outbox.publish([("tokens.gw", b"batch")], "token-batch")
    await asyncio.sleep(0)
    assert bus.writes == [[("_INBOX.a", accepted("r0").to_bytes()), ("tokens.gw", b"batch")]]


async def test_a_held_step_is_written_once_with_what_its_caller_adds():
    bus = Recorder()
    outbox = Outbox(bus, BackgroundTasks("t"))  # type: ignore[arg-type]
    outbox.hold()
    outbox.publish([("tokens.a", b"1")], "token-batch")
    outbox.publish([("tokens.b", b"2")], "token-batch")
    messages = outbox.release()
    assert bus.writes == [] and messages == [("tokens.a", b"1"), ("tokens.b", b"2")]
    outbox.publish([*messages, ("kv.events", b"3")], "kv-events")
    assert bus.writes == [[("tokens.a", b"1"), ("tokens.b", b"2"), ("kv.events", b"3")]]
    assert outbox.release() == []


async def test_what_must_go_through_reply_is_not_queued():
    outbox = Outbox(Recorder(), BackgroundTasks("t"))  # type: ignore[arg-type]
    assert not outbox.reply_soon(Msg(reply=""), accepted("r0"))  # not a request: bus.reply raises
    assert not outbox.reply_soon(Msg(), accepted("x" * 2000))  # over max_payload: bus.reply raises
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("decode.admission"):
        assert trace.get_current_span().get_span_context().is_valid
        assert not outbox.reply_soon(Msg(), accepted("r1"))  # trace context to carry: headers
    assert outbox.reply_soon(Msg(), accepted("r2"))


@pytest.mark.parametrize("connected", [True, False])
async def test_not_connected_or_a_bad_subject_sends_each_on_its_own(connected):
    bus = Recorder(connected)
    tasks = BackgroundTasks("t")
    outbox = Outbox(bus, tasks)  # type: ignore[arg-type]
    assert outbox.reply_soon(Msg(reply="_INBOX.1"), accepted("r1"))
    assert outbox.reply_soon(Msg(reply="bad subject"), accepted("r2"))
    assert outbox.reply_soon(Msg(reply="_INBOX.3"), accepted("r3"))
    await asyncio.sleep(0)
    assert bus.writes == []
    assert [subject for subject, _ in bus.published] == ["_INBOX.1", "_INBOX.3"]
    assert tasks.num_failed == 1  # the bad one, logged and counted as a failed background publish


async def test_a_steps_write_that_fails_still_sends_the_queued_replies():
    bus = Recorder()
    outbox = Outbox(bus, BackgroundTasks("t"))  # type: ignore[arg-type]
    assert outbox.reply_soon(Msg(), accepted("r0"))
    with pytest.raises(BusError):
        outbox.publish([("bad subject", b"batch")], "token-batch")
    assert bus.published == [("_INBOX.a", accepted("r0").to_bytes())]
