"""Admission: route requests wait, in a bounded FIFO, for a decode worker with room.

A decode worker (role decode or both) has *room* while running + waiting (its heartbeat) + in-flight decisions
< its max_num_seqs; one without room is not offered to the policy (a pure prefill worker always is: a prefill
queue drains at compute speed). When live decode workers exist but none has room, the request waits here — at
most `max_queued` requests, each at most `max_wait_s` (keep it below the gateway's route_timeout_s) — and is routed
as soon as a heartbeat shows room, oldest first; past its wait, or with the queue full, it is answered
`overloaded` (the gateway's 503 + Retry-After), before any token is sent.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from deepinfer.bus import IncomingMsg
from deepinfer.membership import Member
from deepinfer.protocol import RouteRequest


def has_room(member: Member, in_flight: Mapping[str, int]) -> bool:
    """Whether a new request would fit in the worker's batch (decode workers; module docstring)."""
    pending = member.num_running + member.num_waiting + in_flight.get(member.worker_id, 0)
    return not member.can_decode or pending < member.max_num_seqs


def with_room(members: Sequence[Member], in_flight: Mapping[str, int]) -> list[Member]:
    """The members a policy may pick from now."""
    return [m for m in members if has_room(m, in_flight)]


@dataclass
class Waiting:
    """One queued route request."""

    request: RouteRequest
    msg: IncomingMsg
    started_s: float
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class AdmissionQueue:
    """The FIFO of waiting requests; `on_expired(waiting)` is called for each whose wait ran out."""

    def __init__(
        self,
        max_queued: int,
        max_wait_s: float,
        on_expired: Callable[[Waiting], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self._on_expired = on_expired
        self._clock = clock
        self._queue: deque[Waiting] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def enqueue(self, request: RouteRequest, msg: IncomingMsg, started_s: float) -> bool:
        """Queue a request (its wait timer starts); False when the queue is full or waiting is off."""
        if len(self._queue) >= self.max_queued or self.max_wait_s <= 0:
            return False
        waiting = Waiting(request, msg, started_s)
        waiting.timer = asyncio.get_running_loop().call_later(self.max_wait_s, self._expire, waiting)
        self._queue.append(waiting)
        return True

    def peek(self) -> Waiting | None:
        """The oldest waiting request."""
        return self._queue[0] if self._queue else None

    def pop(self) -> Waiting:
        """Take the oldest (it was routed): its timer stops."""
        waiting = self._queue.popleft()
        if waiting.timer is not None:
            waiting.timer.cancel()
        return waiting

    def clear(self) -> list[Waiting]:
        """Take every waiting request (the scheduler stops)."""
        taken = [self.pop() for _ in range(len(self._queue))]
        return taken

    def _expire(self, waiting: Waiting) -> None:
        try:
            self._queue.remove(waiting)
        except ValueError:
            return  # routed meanwhile
        self._on_expired(waiting)
