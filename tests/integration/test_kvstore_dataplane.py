"""The kvcache store served by the real DataPlaneServer to a DataPlaneClient on 127.0.0.1: put, get, has, a miss."""

from __future__ import annotations

import pytest

from deepinfer.dataplane import BlockNotFound, DataPlaneClient, DataPlaneServer, generate_secret
from deepinfer.kvcache.store import KvStore, StoreSettings
from tests.kvstore_harness import LAYOUT, OTHER_LAYOUT, MiB, hashes, payload

pytestmark = pytest.mark.integration

NAMES = [f"block-{i}" for i in range(8)]


async def _serve(store: KvStore, secret: str) -> DataPlaneServer:
    server = DataPlaneServer(store, secret=secret)
    await server.start()
    return server


async def test_put_get_has_and_a_miss_over_the_data_plane(tmp_path):
    secret = generate_secret()
    settings = StoreSettings(ram_bytes=4 * MiB, disk_dir=tmp_path / "store", disk_bytes=64 * MiB)
    blocks = [payload(n, 1 * MiB) for n in NAMES]
    store = KvStore(settings)
    server = await _serve(store, secret)
    async with DataPlaneClient(server.address, secret, timeout_s=30) as client:
        await client.put_blocks(LAYOUT, hashes(*NAMES), blocks)  # one round trip, 8 MiB
        assert await client.has_blocks(LAYOUT, hashes(*NAMES, "absent")) == [True] * 8 + [False]
        assert await client.has_blocks(OTHER_LAYOUT, hashes(*NAMES)) == [False] * 8
        # 4 blocks are in RAM, the first 4 only on disk: one get serves both tiers, in request order.
        assert (
            await client.get_blocks("", block_hashes=hashes(*reversed(NAMES)), layout_id=LAYOUT)
            == blocks[::-1]
        )
        with pytest.raises(BlockNotFound, match="not held under layout 'layout-a'"):
            await client.get_blocks("", block_hashes=hashes(NAMES[0], "absent"), layout_id=LAYOUT)
        with pytest.raises(BlockNotFound):  # another layout's view of the same hashes is a clean miss
            await client.get_blocks("", block_hashes=hashes(NAMES[0]), layout_id=OTHER_LAYOUT)
        # An error answer leaves the connection usable.
        assert await client.get_blocks("", block_hashes=hashes(NAMES[0]), layout_id=LAYOUT) == blocks[:1]
    await server.close(drain_timeout_s=5)
    store.close()

    # A restarted store serves the same blocks from disk.
    reopened = KvStore(settings)
    server = await _serve(reopened, secret)
    async with DataPlaneClient(server.address, secret, timeout_s=30) as client:
        assert await client.get_blocks("", block_hashes=hashes(*NAMES), layout_id=LAYOUT) == blocks
    await server.close(drain_timeout_s=5)
    assert reopened.stats().num_disk_blocks == 8
    reopened.close()
