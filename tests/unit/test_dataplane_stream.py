"""BlockStream's buffering, driven the way asyncio's selector transport drives a BufferedProtocol (no sockets):
get_buffer → the bytes that arrived copied into it → buffer_updated, in chunks of any size."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from deepinfer.dataplane.stream import BlockStream


class Transport(asyncio.Transport):
    """What BlockStream asks of its transport: reading paused or not, bytes written, closing."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.closing = False
        self.written = bytearray()

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data) -> None:
        self.written += data

    def close(self) -> None:
        self.closing = True


def _connected(staging_bytes: int = 64) -> tuple[BlockStream, Transport]:
    stream, transport = BlockStream(staging_bytes=staging_bytes), Transport()
    stream.connection_made(transport)
    return stream, transport


def _arrive(stream: BlockStream, transport: Transport, data: bytes, max_chunk: int) -> int:
    """Deliver `data` as a transport would, at most `max_chunk` bytes per recv_into, while reading is not paused;
    how many bytes were delivered."""
    sent = 0
    while sent < len(data) and not transport.paused:
        buffer = stream.get_buffer(-1)
        assert len(buffer) > 0, "get_buffer() returned an empty buffer"
        n = min(len(buffer), max_chunk, len(data) - sent)
        buffer[:n] = data[sent : sent + n]
        stream.buffer_updated(n)
        sent += n
    return sent


async def _feed(stream: BlockStream, transport: Transport, data: bytes, chunks: list[int]) -> None:
    """Deliver `data` in the given chunk sizes (cycled), yielding to the reader whenever reading is paused."""
    sent, i = 0, 0
    while sent < len(data):
        if transport.paused:
            await asyncio.sleep(0)
            continue
        sent += _arrive(stream, transport, data[sent : sent + chunks[i % len(chunks)]], chunks[i % len(chunks)])
        i += 1
        await asyncio.sleep(0)


@pytest.mark.parametrize("chunks", [[1], [7, 1, 300], [4096], [1 << 20]])
async def test_a_frame_split_across_any_number_of_receives_reads_back_whole(chunks):
    stream, transport = _connected(staging_bytes=64)
    head, blocks = os.urandom(10), [os.urandom(5000), os.urandom(1), os.urandom(70_000)]
    feeder = asyncio.create_task(_feed(stream, transport, head + b"".join(blocks), chunks))
    assert await stream.readexactly(10) == head
    for block in blocks:
        buffer = bytearray(len(block))
        await stream.readinto(buffer)
        assert buffer == block
    await feeder
    assert stream.num_staged == 0


async def test_a_block_goes_straight_into_the_readers_buffer_once_the_staged_bytes_are_taken():
    stream, transport = _connected(staging_bytes=64)
    _arrive(stream, transport, b"early", 100)  # arrived before anyone read: staged
    buffer = bytearray(1000)
    reading = asyncio.create_task(stream.readinto(buffer))
    await asyncio.sleep(0)
    target = stream.get_buffer(-1)
    assert len(target) == 995  # the rest of the reader's own buffer, not the staging buffer
    target[:] = b"x" * 995
    stream.buffer_updated(995)
    await reading
    assert buffer == b"early" + b"x" * 995


async def test_a_full_staging_buffer_pauses_reading_until_it_is_consumed():
    stream, transport = _connected(staging_bytes=16)
    assert _arrive(stream, transport, os.urandom(40), 5) == 16
    assert transport.paused
    assert len(await stream.readexactly(10)) == 10
    assert not transport.paused
    assert len(stream.get_buffer(-1)) == 10  # the 6 unread bytes moved to the front


async def test_a_connection_closed_mid_block_is_an_incomplete_read():
    stream, transport = _connected()
    buffer = bytearray(100)
    reading = asyncio.create_task(stream.readinto(buffer))
    await asyncio.sleep(0)
    _arrive(stream, transport, b"a" * 30, 100)
    stream.eof_received()
    with pytest.raises(asyncio.IncompleteReadError) as caught:
        await reading
    assert caught.value.partial == b"a" * 30 and caught.value.expected == 100
    with pytest.raises(asyncio.IncompleteReadError):
        await stream.readexactly(1)
    assert stream.at_eof()


async def test_a_lost_connection_fails_the_reader_and_the_writer():
    stream, transport = _connected()
    reading = asyncio.create_task(stream.readexactly(4))
    await asyncio.sleep(0)
    stream.pause_writing()
    draining = asyncio.create_task(stream.drain())
    await asyncio.sleep(0)
    stream.connection_lost(ConnectionResetError("peer reset"))
    with pytest.raises(asyncio.IncompleteReadError):
        await reading
    with pytest.raises(ConnectionResetError):
        await draining
    await asyncio.wait_for(stream.wait_closed(), timeout=1)


async def test_drain_waits_while_the_transport_is_over_its_high_water_mark():
    stream, transport = _connected()
    stream.write(b"abc")
    stream.pause_writing()
    draining = asyncio.create_task(stream.drain())
    await asyncio.sleep(0)
    assert not draining.done()
    stream.resume_writing()
    await asyncio.wait_for(draining, timeout=1)
    assert transport.written == b"abc"


async def test_random_chunking_never_loses_or_reorders_a_byte():
    rng = random.Random(5)
    stream, transport = _connected(staging_bytes=32)
    sizes = [rng.randint(1, 3000) for _ in range(40)]
    data = os.urandom(sum(sizes))
    feeder = asyncio.create_task(_feed(stream, transport, data, [rng.randint(1, 500) for _ in range(50)]))
    got = bytearray()
    for i, size in enumerate(sizes):
        if i % 3 == 0:
            got += await stream.readexactly(size)
        else:
            buffer = bytearray(size)
            await stream.readinto(buffer)
            got += buffer
    await feeder
    assert got == data
