"""BlockingPutClient (a writer thread's puts over a blocking socket) against a real DataPlaneServer over a KvStore on
127.0.0.1: blocks put from read-only views are served back whole to the async client; a connection the server closed
while idle is reconnected; a wrong secret, a refused put and a dead peer raise the data plane's errors."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer.dataplane import (
    DataPlaneAuthError,
    DataPlaneClient,
    DataPlaneConnectionError,
    DataPlaneServer,
    ServerTimeouts,
)
from deepinfer.dataplane.blocking import BlockingPutClient
from deepinfer.kvcache.store import KvStore, StoreSettings
from tests.kvstore_harness import LAYOUT, MiB, hashes, payload

pytestmark = pytest.mark.integration

SECRET = "blocking-put-test-secret-012345"
NAMES = [f"block-{i}" for i in range(70)]  # more than one frame of 64


@pytest.fixture
def store(tmp_path):
    with KvStore(StoreSettings(ram_bytes=64 * MiB, disk_dir=tmp_path / "store", disk_bytes=256 * MiB)) as opened:
        yield opened


async def test_blocks_put_from_a_thread_are_served_back_whole(store):
    server = DataPlaneServer(store, secret=SECRET, timeouts=ServerTimeouts(idle_s=0.3))
    await server.start()
    putter = BlockingPutClient(server.address, SECRET, timeout_s=5)
    try:
        arena = bytearray(b"".join(payload(n, 8192) for n in NAMES))  # slots of one buffer, as the host tier's
        views = [memoryview(arena)[i * 8192 : (i + 1) * 8192].toreadonly() for i in range(len(NAMES))]
        await asyncio.to_thread(putter.put_blocks, LAYOUT, hashes(*NAMES), views)
        assert putter.metrics.requests == 2 and putter.metrics.blocks_sent == 70
        async with DataPlaneClient(server.address, SECRET) as reader:
            got = await reader.get_blocks("", block_hashes=hashes(*NAMES), layout_id=LAYOUT)
        assert got == [payload(n, 8192) for n in NAMES]

        await asyncio.sleep(0.6)  # the server closes the idle connection: the next put reconnects
        await asyncio.to_thread(putter.put_blocks, LAYOUT, hashes("late"), [payload("late")])
        assert store.has_blocks(LAYOUT, hashes("late")) == [True]
    finally:
        putter.close()
        await server.close()


async def test_a_wrong_secret_a_refused_put_and_a_dead_peer_raise(store):
    server = DataPlaneServer(store, secret=SECRET)
    await server.start()
    try:
        wrong = BlockingPutClient(server.address, "another-secret-0123456789abcdef", timeout_s=5)
        with pytest.raises(DataPlaneAuthError):
            await asyncio.to_thread(wrong.put_blocks, LAYOUT, hashes("a"), [payload("a")])
        putter = BlockingPutClient(server.address, SECRET, timeout_s=5)
        with pytest.raises(ValueError):
            putter.put_blocks(LAYOUT, hashes("a", "b"), [payload("a")])
        with pytest.raises(Exception, match="layout") as refused:  # the store refuses an empty layout id
            await asyncio.to_thread(putter.put_blocks, "", hashes("a"), [payload("a")])
        assert putter.metrics.errors == 1, refused.value
        await asyncio.to_thread(putter.put_blocks, LAYOUT, hashes("a"), [payload("a")])  # still usable
        assert store.has_blocks(LAYOUT, hashes("a")) == [True]
        address = server.address
    finally:
        await server.close()
    with pytest.raises(DataPlaneConnectionError):
        await asyncio.to_thread(putter.put_blocks, LAYOUT, hashes("b"), [payload("b")])
    putter.close()
    with pytest.raises(DataPlaneConnectionError):
        await asyncio.to_thread(BlockingPutClient(address, SECRET, timeout_s=5).put_blocks, LAYOUT, hashes("c"),
                                [payload("c")])
