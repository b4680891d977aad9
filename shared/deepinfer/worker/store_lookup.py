"""`StoreLookups`: a worker's admission lookups in the kvcache store, coalesced. Requests that arrive together
(a wave of admissions) are asked about in one `has` of the union of their blocks, not in a round trip each.

    add_request ─ leading(hashes) ─► pending ─► one `has` (each block once; one request per shard, all shards
                                                at once) ─► each request: the leading run of its blocks held
    the first request of a turn of the loop schedules the lookup (call_soon); while one is in flight, those that
    arrive meanwhile wait for it to end and then go together in the next one
    a failed or late lookup (timeout_s): every request in it gets 0, a miss (recomputed), never an error

At most one lookup is in flight: a shard's connection answers one request at a time anyway (in a burst of 64
the per-request lookups queued behind each other there, each a round trip through the shard's event loop). They
go on a connection of their own ("lookup"), never behind a load's get or a write-behind's has.
A request waits timeout_s at most in all: a lookup's time is what is left of its oldest request's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from prometheus_client import Counter

from deepinfer.kvcache.client import KvStoreClient

log = logging.getLogger(__name__)


class StoreLookups:
    """How many leading blocks of a request the store holds, asked together for requests that arrive together."""

    def __init__(self, client: KvStoreClient, layout_id: str, timeout_s: float, results: Counter,
                 round_trips: Counter) -> None:
        self.client = client
        self.layout_id = layout_id
        self.timeout_s = timeout_s
        #: Requests looked up, by result (hit, miss, error): labelled `result`.
        self._results = results
        #: Lookups sent (each one `has` for every request waiting).
        self._round_trips = round_trips
        #: Requests waiting for the next lookup: (hashes, answer, loop time it arrived).
        self._pending: list[tuple[Sequence[bytes], asyncio.Future[int], float]] = []
        self._scheduled = False
        self._in_flight: asyncio.Task[None] | None = None
        self._closed = False

    async def leading(self, hashes: Sequence[bytes]) -> int:
        """How many of these blocks, from the first, the store holds (0 with no live shard, or on any failure)."""
        if not hashes or self._closed or not self.client.has_shards():
            return 0
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        self._pending.append((hashes, future, loop.time()))
        if self._in_flight is None and not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._send)  # the requests whose tasks run in this turn of the loop join it
        return await future

    async def close(self) -> None:
        """Stop: the lookup in flight is cancelled, and every request waiting gets 0."""
        self._closed = True
        task = self._in_flight
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        pending, self._pending = self._pending, []
        _answer_misses(pending)

    def _send(self) -> None:
        self._scheduled = False
        if self._in_flight is not None or not self._pending or self._closed:
            return
        batch, self._pending = self._pending, []
        self._in_flight = asyncio.get_running_loop().create_task(self._lookup(batch), name="store-lookup")

    async def _lookup(self, batch: list[tuple[Sequence[bytes], asyncio.Future[int], float]]) -> None:
        try:
            unique = list(dict.fromkeys(h for hashes, _, _ in batch for h in hashes))
            left_s = min(arrived for _, _, arrived in batch) + self.timeout_s - asyncio.get_running_loop().time()
            self._round_trips.inc()
            try:
                present = await asyncio.wait_for(self.client.has(self.layout_id, unique, connection="lookup"),
                                                 max(0.0, left_s))
                held = {h for h, flag in zip(unique, present, strict=True) if flag}
                failed = False
            except Exception as exc:  # a slow or failed lookup only costs the recompute
                log.debug("store lookup of %d blocks for %d requests failed: %r", len(unique), len(batch), exc)
                held, failed = set(), True
            for hashes, future, _ in batch:
                num_held = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
                self._results.labels("error" if failed else "hit" if num_held else "miss").inc()
                if not future.done():  # its admission may have been cancelled meanwhile
                    future.set_result(num_held)
        finally:
            _answer_misses(batch)  # cancelled (close) or an error above: never leave an admission waiting
            self._in_flight = None
            if self._pending:
                self._send()  # those that arrived meanwhile: one lookup for all of them, now


def _answer_misses(batch: list[tuple[Sequence[bytes], asyncio.Future[int], float]]) -> None:
    for _, future, _ in batch:
        if not future.done():
            future.set_result(0)

