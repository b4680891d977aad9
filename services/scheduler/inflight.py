"""Decisions not yet reflected in the chosen workers' heartbeats, counted per worker.

Every replica counts its own decisions and those its peers publish on `decisions(model)`, so replicas do not
herd onto the same worker between two heartbeats (docs/architecture.md §6). A count ends when it is `ttl_s` old, or
when a heartbeat shows the request arrived: a heartbeat whose `num_received` (requests the worker admitted
since it started, protocol 2.2) grew by n ends the n oldest counts of that worker (a smaller value is a
restart: all end); from a worker without it, a heartbeat ends the counts at least `settle_s` old (by then the
request has most likely reached the worker and shows in num_running/num_waiting). Clock injected; pure
bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from deepinfer.protocol import RouteDecision, RouteStatus

#: Default life of an in-flight count when no heartbeat ends it first.
DEFAULT_TTL_S = 5.0
#: Default age a decision must have before a heartbeat is taken to include it.
DEFAULT_SETTLE_S = 0.05


class InFlight:
    """Per worker: request_id -> when the decision was counted (our monotonic clock)."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        settle_s: float = DEFAULT_SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self._clock = clock
        self._by_worker: dict[str, dict[str, float]] = {}
        self._received: dict[str, int] = {}

    def add(self, decision: RouteDecision) -> None:
        """Count an accepted decision against its prefill and decode workers (once per request_id)."""
        if decision.status is not RouteStatus.ACCEPTED:
            return
        now_s = self._clock()
        for worker_id in {decision.prefill_worker_id, decision.decode_worker_id}:
            if worker_id is not None:
                self._by_worker.setdefault(worker_id, {}).setdefault(decision.request_id, now_s)

    def on_heartbeat(self, worker_id: str, num_received: int | None = None) -> None:
        """A heartbeat of `worker_id` arrived: drop the counts of the requests it shows (module docstring)."""
        previous = self._received.get(worker_id)
        if num_received is not None:
            self._received[worker_id] = num_received
        entries = self._by_worker.get(worker_id)
        if not entries:
            return
        if num_received is None or previous is None:
            cutoff_s = self._clock() - self.settle_s
            ended = [r for r, counted_s in entries.items() if counted_s <= cutoff_s]
        elif num_received < previous:
            ended = list(entries)
        else:
            ended = list(entries)[: num_received - previous]  # insertion order: oldest first
        for request_id in ended:
            del entries[request_id]
        if not entries:
            del self._by_worker[worker_id]

    def expire(self) -> int:
        """Drop counts older than `ttl_s`; returns how many were dropped."""
        cutoff_s = self._clock() - self.ttl_s
        num_dropped = 0
        for worker_id in list(self._by_worker):
            entries = self._by_worker[worker_id]
            for request_id in [r for r, counted_s in entries.items() if counted_s <= cutoff_s]:
                del entries[request_id]
                num_dropped += 1
            if not entries:
                del self._by_worker[worker_id]
        return num_dropped

    def forget_worker(self, worker_id: str) -> None:
        """Drop every count of a worker that left."""
        self._by_worker.pop(worker_id, None)
        self._received.pop(worker_id, None)

    def counts(self) -> dict[str, int]:
        """worker_id -> number of in-flight decisions (workers with none are absent)."""
        return {worker_id: len(entries) for worker_id, entries in self._by_worker.items()}

    def total(self) -> int:
        """In-flight (worker, request) pairs across all workers."""
        return sum(len(entries) for entries in self._by_worker.values())
