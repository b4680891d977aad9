"""`Outbox`: a worker's pre-encoded messages on their way to the socket, in as few writes as the loop allows.

    step's token batches ─┐
    step's KV event batch ─┴─► one `publish_now` (one sendmsg) per engine step
    replies (admissions) ────► queued; sent together once per turn of the loop, or with the next step's write

Each `publish_now` is a socket write, a syscall that hands the GIL to the engine thread and waits to get it
back; `publish`/`reply` is a chain of coroutines (ours, then nats-py's) per message, then nats-py's flusher
task. A wave of 64 admissions replies 64 times within a turn or two of the loop: their replies are queued here
and written at once. What goes on the wire is unchanged: the same messages, each subject's in the same order
(a reply queued before a step's batches is written ahead of them). A reply that must carry trace context goes
through `reply` as before (headers); when not connected, each message goes through `publish`, which buffers
while reconnecting or fails (logged, counted) as any background publish does.
"""

from __future__ import annotations

import asyncio
import contextvars

from deepinfer.bus import BusError, IncomingMsg, MessageBus
from deepinfer.bus.envelope import outgoing_headers
from deepinfer.protocol import Message
from deepinfer.tasks import BackgroundTasks
from deepinfer.worker.eager import run_eagerly


class Outbox:
    """Writes of one worker's event loop (not thread-safe: call on the loop)."""

    def __init__(self, bus: MessageBus, tasks: BackgroundTasks) -> None:
        self.bus = bus
        self.tasks = tasks
        #: Replies queued since the last write (a callback to send them is scheduled while there are any).
        self._replies: list[tuple[str, bytes]] = []
        #: The messages of the step being handled while it is held (`hold`), else None.
        self._held: list[tuple[str, bytes]] | None = None

    def hold(self) -> None:
        """Collect what `publish` gets from now on, until `release` (the caller sends it with its own messages)."""
        self._held = []

    def release(self) -> list[tuple[str, bytes]]:
        """Stop collecting; the messages collected since `hold` (the caller sends them)."""
        held, self._held = self._held, None
        return held if held is not None else []

    def publish(self, messages: list[tuple[str, bytes]], name: str) -> None:
        """Send pre-encoded messages (no headers) now, behind any queued reply, in one write; while held (a step
        with KV events), with the step's other messages."""
        if self._held is not None:
            self._held += messages
            return
        if self._replies:
            replies = self._take_replies()
            try:
                sent = self.bus.publish_now(replies + messages)
            except BusError:  # nothing was sent (PayloadTooLarge, a bad subject): the replies go on their own
                self._publish_each(replies, "reply")
                raise
            if not sent:
                self._publish_each(replies, "reply")
                self._publish_each(messages, name)
        elif not self.bus.publish_now(messages):
            self._publish_each(messages, name)

    def reply_soon(self, msg: IncomingMsg, reply: Message) -> bool:
        """Queue `reply` to `msg` for the next write; False (nothing queued) when it must go through `bus.reply`:
        no reply subject (BusError there), trace context to carry, or over max_payload (PayloadTooLarge there)."""
        if not msg.reply or outgoing_headers(None) is not None:
            return False
        payload = reply.to_bytes()
        if len(payload) > self.bus.max_payload:
            return False
        if not self._replies:  # in an empty context: no request's context leaks into the send
            asyncio.get_running_loop().call_soon(self._send_replies, context=contextvars.Context())
        self._replies.append((msg.reply, payload))
        return True

    def _send_replies(self) -> None:
        if not self._replies:  # a step's write took them
            return
        replies = self._take_replies()
        try:
            sent = self.bus.publish_now(replies)
        except BusError:  # a bad reply subject: each alone, so the others still go (the bad one fails, logged)
            sent = False
        if not sent:
            self._publish_each(replies, "reply")

    def _take_replies(self) -> list[tuple[str, bytes]]:
        replies, self._replies = self._replies, []
        return replies

    def _publish_each(self, messages: list[tuple[str, bytes]], name: str) -> None:
        for subject, payload in messages:
            run_eagerly(self.tasks, self.bus.publish(subject, payload), name=name)
