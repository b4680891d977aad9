"""One subscription per gateway on `tokens(model, gateway_id)`, demultiplexed by request_id into per-request queues.

Decode workers send one TokenBatch per engine step per gateway (batched, because a message per token would cap
a node far below its GPUs); the gateway splits each batch into its requests' chunks here.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from deepinfer import subjects
from deepinfer.bus import IncomingMsg, MessageBus, Subscription
from deepinfer.protocol import TokenBatch, TokenChunk

logger = logging.getLogger(__name__)


class ChunkQueue:
    """One consumer's FIFO of chunks: asyncio.Queue's put_nowait / get_nowait / empty / qsize, and `wait` for the
    next one with a timeout that costs one future and one timer (`asyncio.wait_for(queue.get(), t)` made a task
    per call: per token per stream when the gateway keeps up)."""

    def __init__(self) -> None:
        self._items: deque[TokenChunk] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, chunk: TokenChunk) -> None:
        """Queue `chunk` and wake the waiting consumer."""
        self._items.append(chunk)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> TokenChunk:
        """The oldest chunk (IndexError when empty)."""
        return self._items.popleft()

    def empty(self) -> bool:
        """Whether no chunk is queued."""
        return not self._items

    def qsize(self) -> int:
        """How many chunks are queued."""
        return len(self._items)

    async def wait(self, timeout_s: float) -> bool:
        """Until a chunk is queued (True) or `timeout_s` passed without one (False)."""
        if self._items:
            return True
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        return bool(self._items)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class RequestStream:
    """The TokenChunks of one request, in arrival order; close it when the request ends."""

    def __init__(self, owner: TokenStreams, request_id: str, num_previous_tokens: int | None = None) -> None:
        self.request_id = request_id
        self.queue = ChunkQueue()
        #: The output position the next chunk must start at (None: not checked until a chunk says).
        self.next_position = num_previous_tokens
        #: Why the chunks stopped being usable (a gap: a chunk lost in transit); later chunks are dropped.
        self.broken: str | None = None
        self._owner = owner

    def put(self, chunk: TokenChunk) -> None:
        """Queue a chunk that continues the stream; a repeat is dropped, a gap breaks the stream."""
        if self.broken is not None:
            return
        position, expected = chunk.num_previous_tokens, self.next_position
        if position is not None and expected is not None and position != expected:
            if position + len(chunk.token_ids) <= expected and chunk.finish_reason is None and chunk.error is None:
                return  # tokens already here (a repeated message)
            self.broken = f"output tokens {expected}..{position} were lost in transit"
            logger.warning("request %s: %s", self.request_id, self.broken)
            return
        if position is not None:
            self.next_position = position + len(chunk.token_ids)
        self.queue.put_nowait(chunk)

    async def get(self, timeout_s: float) -> TokenChunk | None:
        """Every chunk that arrived since the last call, merged into one (None when none came within `timeout_s`).

        Merging is the backpressure: a gateway that falls behind its decode workers detokenizes, formats and writes
        one SSE event per stream for all the steps it missed, instead of one per step (which would put it further
        behind). A gateway that keeps up gets one chunk at a time, as sent.
        """
        if self.queue.empty():
            if self.broken is not None:
                return None
            if not await self.queue.wait(timeout_s):
                return None
        # chunks arrive a step's worth at a time: most gets need no timer
        chunk = self.queue.get_nowait()
        while not self.queue.empty() and chunk.finish_reason is None and chunk.error is None:
            chunk = merge_chunks(chunk, self.queue.get_nowait())
        return chunk

    def close(self) -> None:
        """Stop routing this request's chunks here (later ones are dropped)."""
        self._owner.forget(self.request_id)


def merge_chunks(first: TokenChunk, then: TokenChunk) -> TokenChunk:
    """One chunk with the tokens (and logprobs) of both, in order; the end (finish, error) is the later one's."""
    logprobs = None if first.logprobs is None or then.logprobs is None else [*first.logprobs, *then.logprobs]
    return TokenChunk(
        request_id=first.request_id,
        token_ids=[*first.token_ids, *then.token_ids],
        logprobs=logprobs,
        finish_reason=then.finish_reason,
        num_cached_tokens=first.num_cached_tokens if first.num_cached_tokens is not None else then.num_cached_tokens,
        cached_tokens_by_tier=(
            first.cached_tokens_by_tier if first.num_cached_tokens is not None else then.cached_tokens_by_tier
        ),
        error=then.error,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs,
        num_previous_tokens=first.num_previous_tokens,
    )


class TokenStreams:
    """The gateway's token subject and the request streams open on it."""

    def __init__(self, bus: MessageBus, model: str, gateway_id: str) -> None:
        self.subject = subjects.tokens(model, gateway_id)
        self._bus = bus
        self._streams: dict[str, RequestStream] = {}
        self._subscription: Subscription | None = None
        self.num_dropped_chunks = 0

    async def start(self) -> None:
        """Subscribe to this gateway's token subject (once)."""
        if self._subscription is None:
            self._subscription = await self._bus.subscribe(self.subject, self.on_batch, message_type=TokenBatch)

    async def stop(self) -> None:
        """Unsubscribe; open streams receive nothing more."""
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None

    def open(self, request_id: str, num_previous_tokens: int | None = None) -> RequestStream:
        """Start collecting `request_id`'s chunks (the first one continuing at output position
        `num_previous_tokens`); open BEFORE asking a worker to decode, or early ones are lost."""
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} already has an open stream")
        stream = RequestStream(self, request_id, num_previous_tokens)
        self._streams[request_id] = stream
        return stream

    def forget(self, request_id: str) -> None:
        """Drop a request's stream (idempotent)."""
        self._streams.pop(request_id, None)

    @property
    def num_open(self) -> int:
        """Requests with an open stream."""
        return len(self._streams)

    async def on_batch(self, batch: TokenBatch, msg: IncomingMsg | None = None) -> None:
        """Bus handler: route each chunk to its request's queue; chunks of unknown requests are dropped."""
        for chunk in batch.chunks:
            stream = self._streams.get(chunk.request_id)
            if stream is None:
                self.num_dropped_chunks += 1  # finished, cancelled or another gateway's id: nothing to do
                continue
            stream.put(chunk)
