"""BlockingPutClient (a writer thread's puts over a blocking socket) against a real DataPlaneServer over a KvStore on
127.0.0.1: blocks put from read-only views are served back whole to the async client; a connection the server closed
while idle is reconnected; a wrong secret, a refused put and a dead peer raise the data plane's errors. And
KvStoreClient.put on its writer threads: a cancelled put returns only once its payloads were sent; a dead shard is
forgotten."""

from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer.dataplane import (
    DataPlaneAuthError,
    DataPlaneClient,
    DataPlaneConnectionError,
    DataPlaneServer,
    ServerTimeouts,
)
from deepinfer.dataplane.blocking import BlockingPutClient
from deepinfer.kvcache.client import KvStoreClient
from deepinfer.kvcache.store import KvStore, StoreSettings
from deepinfer.protocol import KvStoreHeartbeat
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


def _client_of(server: DataPlaneServer) -> KvStoreClient:
    client = KvStoreClient(SECRET, timeout_s=5, shard_lease_s=600)
    client.shards.observe(KvStoreHeartbeat(shard="s0", data_plane_address=server.address, internal_address="",
                                           ts=time.time()))
    return client


async def test_a_store_put_runs_on_a_writer_thread_and_a_cancelled_one_returns_once_sent(store):
    server = DataPlaneServer(store, secret=SECRET)
    await server.start()
    client = _client_of(server)
    try:
        names = NAMES[:8]
        assert await client.put(LAYOUT, hashes(*names), [payload(n, 1 << 20) for n in names]) == 8
        assert store.has_blocks(LAYOUT, hashes(*names)) == [True] * 8
        late = [f"late-{i}" for i in range(32)]
        put = asyncio.create_task(client.put(LAYOUT, hashes(*late), [payload(n, 1 << 20) for n in late]))
        await asyncio.sleep(0.01)
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        # The caller gets control back only once the thread stopped reading the payloads: the put was whole.
        assert store.has_blocks(LAYOUT, hashes(*late)) == [True] * 32
    finally:
        await client.close()
        await server.close()


async def test_a_store_put_to_a_dead_shard_raises_and_forgets_it(store):
    server = DataPlaneServer(store, secret=SECRET)
    await server.start()
    client = _client_of(server)
    await server.close()
    try:
        with pytest.raises(DataPlaneConnectionError):
            await client.put(LAYOUT, hashes("a"), [payload("a")])
        assert not client.has_shards()  # its blocks are misses until it heartbeats again
    finally:
        await client.close()
