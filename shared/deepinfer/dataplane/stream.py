"""BlockStream: one data-plane connection as an asyncio BufferedProtocol, reading block bytes in place.

    transport ── recv_into ──► the caller's block buffer   while a `readinto(buffer)` waits (no copy in between)
                          └──► a small staging buffer       otherwise (headers, the handshake, bytes that arrived
                                                            early); `readinto` takes those first, then waits

asyncio's StreamReader appends every read to one bytearray, `readexactly` cuts a new `bytes` out of it and then
deletes it from the front (two copies of every payload byte, and a memmove). Here the kernel copies the bytes
straight into the buffer they will live in. The staging buffer is bounded: when it is full, reading pauses (TCP
back-pressure) until the owner consumes it. One reader at a time (the connection's task).

It is also the connection's writer (`write` / `drain` / `close`, like a StreamWriter) so the handshake and the
frames run on it as on a stream pair.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

#: Bytes the staging buffer holds: a header, a handshake, the start of the next payload.
STAGING_BYTES = 256 * 1024


class BlockStream(asyncio.BufferedProtocol):
    """A connection that reads into caller-provided buffers; `on_connect(stream)` runs when it is made."""

    def __init__(
        self, on_connect: Callable[[BlockStream], Any] | None = None, staging_bytes: int = STAGING_BYTES
    ) -> None:
        self.transport: asyncio.Transport | None = None
        self._on_connect = on_connect
        self._staging = bytearray(staging_bytes)
        self._start = 0  # staged, unread bytes are _staging[_start:_end]
        self._end = 0
        self._target: memoryview | None = None  # the part of a readinto buffer still to fill
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._lost: BaseException | None = None
        self._reading_paused = False
        self._writing_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- protocol callbacks (the event loop calls these) -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # noqa: D102
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self._on_connect is not None:
            self._on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:  # noqa: D102
        if self._target is not None:
            return self._target
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start and len(self._staging) - self._end < len(self._staging) // 2:
            unread = self._end - self._start  # little room left at the end: move the unread bytes to the front
            self._staging[:unread] = self._staging[self._start : self._end]
            self._start, self._end = 0, unread
        return memoryview(self._staging)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:  # noqa: D102
        if self._target is not None:
            self._target = self._target[nbytes:]
            if not self._target.nbytes:
                self._target = None
                self._wake()
            return
        self._end += nbytes
        if self._end == len(self._staging) and self._start == 0:
            self._pause_reading()  # full: the owner must consume before more is read
        self._wake()

    def eof_received(self) -> bool:  # noqa: D102
        self._eof = True
        self._wake()
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102
        self._eof = True
        self._lost = exc if exc is not None else ConnectionResetError("connection lost")
        self._wake()
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("connection lost"))
        self._drain_waiters.clear()
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:  # noqa: D102
        self._writing_paused = True

    def resume_writing(self) -> None:  # noqa: D102
        self._writing_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    # -- reading -------------------------------------------------------------------------------------------------
    @property
    def num_staged(self) -> int:
        """Bytes received and not read yet."""
        return self._end - self._start

    async def readexactly(self, n: int) -> bytes:
        """The next n bytes; asyncio.IncompleteReadError when the peer closes first.

        Up to half the staging buffer is read through it (one receive takes a whole small request, however it is
        split into reads); more goes straight into a buffer of its own.
        """
        if n > len(self._staging) // 2:
            buffer = bytearray(n)
            await self.readinto(memoryview(buffer))
            return bytes(buffer)
        while self.num_staged < n:
            if self._eof:
                raise asyncio.IncompleteReadError(bytes(self._staging[self._start : self._end]), n)
            await self._wait_staged()
        data = bytes(self._staging[self._start : self._start + n])
        self._consumed(n)
        return data

    async def readinto(self, buffer: bytearray | memoryview) -> None:
        """Fill `buffer` (writable) with the next bytes: staged ones first, then straight from the socket.

        asyncio.IncompleteReadError when the peer closes first. A cancelled call leaves the stream out of sync:
        close it.
        """
        buffer = memoryview(buffer).cast("B")
        if self._waiter is not None:
            raise RuntimeError("BlockStream.readinto: another read is waiting")
        take = min(buffer.nbytes, self.num_staged)
        if take:
            buffer[:take] = self._staging[self._start : self._start + take]
            self._consumed(take)
        if take == buffer.nbytes:
            return
        if self._eof:
            raise asyncio.IncompleteReadError(bytes(buffer[:take]), buffer.nbytes)
        self._target = buffer[take:]
        self._resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
            missing = self._target
            self._target = None
        if missing is not None:  # woken by the end of the stream
            got = buffer.nbytes - missing.nbytes
            raise asyncio.IncompleteReadError(bytes(buffer[:got]), buffer.nbytes)

    async def _wait_staged(self) -> None:
        """Until more bytes are staged or the stream ends."""
        if self._waiter is not None:
            raise RuntimeError("BlockStream: another read is waiting")
        self._resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def at_eof(self) -> bool:
        """The peer closed and every received byte was read."""
        return self._eof and not self.num_staged

    # -- writing (a StreamWriter's surface) --------------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue bytes on the transport (it sends what it can at once, from `data` itself)."""
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its low-water mark; ConnectionResetError if it was lost."""
        if self._lost is not None or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("connection lost")
        if not self._writing_paused:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def close(self) -> None:
        """Close the transport (buffered bytes are still sent)."""
        if self.transport is not None:
            self.transport.close()

    async def wait_closed(self) -> None:
        """Until the connection is lost."""
        await asyncio.shield(self._closed)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The transport's extra info (peername, socket, ...)."""
        return default if self.transport is None else self.transport.get_extra_info(name, default)

    # -- internals -----------------------------------------------------------------------------------------------
    def _consumed(self, n: int) -> None:
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        self._resume_reading()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (self._target is None or self._eof):
            waiter.set_result(None)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.transport.is_closing():
            self._reading_paused = False
            self.transport.resume_reading()


__all__ = ["STAGING_BYTES", "BlockStream"]
