"""The P/D handoff through Mooncake Transfer Engine, loopback TCP: a prefill-side provider's export slots
(deepinfer.worker.handoff_exports, registered with one engine) read by a decode-side reader
(TransferEngineReads.get_held, another engine) are byte-identical to the data-plane get; a request or block never
leased gets nothing; leased slots are not reused until release or the request's lease ends.

Skips, saying why, without the `transfer-engine` extra or libibverbs1 (.ci/run installs both)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from deepinfer.dataplane import (
    BlockNotFound,
    DataPlaneAuthError,
    DataPlaneClient,
    DataPlaneError,
    DataPlaneServer,
    LeaseExpired,
    generate_secret,
)
from deepinfer.dataplane.frames import LeaseVia
from deepinfer.dataplane.transfer_engine import (
    Transfer,
    TransferEngine,
    availability,
    buffer_address,
)
from deepinfer.kvcache.client.remote import TransferEngineReads
from deepinfer.kvcache.shm.region import TornRead
from deepinfer.testing.dataplane import InMemoryBlockProvider
from deepinfer.worker.handoff_exports import HandoffExports

pytestmark = pytest.mark.integration

if reason := availability():
    pytest.skip(f"transfer engine unavailable: {reason}", allow_module_level=True)

LAYOUT = "layout-pd"
BLOCK_BYTES = 40_000  # not a multiple of a page: a slot is one block rounded up (40,960 bytes)
BLOCK_IDS = [7, 3, 12, 5]
PAYLOADS = [os.urandom(BLOCK_BYTES) for _ in BLOCK_IDS]


@pytest.fixture(scope="module")
def decode_engine():
    """The decode side's engine: this process's one (as in a worker)."""
    return TransferEngine.shared("127.0.0.1")


@pytest.fixture(scope="module")
def prefill_engine():
    """The prefill side's engine: a second one, its own ports (the library runs two in one process)."""
    return TransferEngine.start("127.0.0.1")


class Owner:
    """A prefill-side provider with export slots for `num_slots` blocks, behind a data-plane server."""

    def __init__(self, engine: TransferEngine, num_slots: int) -> None:
        self.secret = generate_secret()
        self.exports = HandoffExports(engine, num_slots * 40_960, BLOCK_BYTES)
        self.provider = InMemoryBlockProvider(exports=self.exports)
        self.server = DataPlaneServer(self.provider, secret=self.secret)

    def client(self, secret: str | None = None) -> DataPlaneClient:
        return DataPlaneClient(self.server.address, secret or self.secret, timeout_s=30)


@pytest.fixture
async def owner(prefill_engine):
    owner = Owner(prefill_engine, num_slots=8)
    await owner.server.start()
    owner.provider.add_lease("r1", BLOCK_IDS, PAYLOADS)
    yield owner
    await owner.server.close()
    owner.exports.close()


async def test_handed_off_blocks_through_the_engine_equal_the_data_plane_get(owner, decode_engine):
    reads = TransferEngineReads(engine=decode_engine)
    async with owner.client() as client:
        over_socket = [bytes(b) for b in await client.get_blocks("r1", BLOCK_IDS, layout_id=LAYOUT)]
        through_engine = await reads.get_held(client, "r1", BLOCK_IDS, LAYOUT)
    assert [bytes(b) for b in through_engine] == over_socket == PAYLOADS
    assert reads.num_blocks == len(BLOCK_IDS)
    assert owner.exports.num_free_slots == owner.exports.num_slots  # released: every slot free again
    # One buffer for the batch, registered for it and no longer.
    addresses = [buffer_address(block)[0] for block in through_engine]
    assert addresses == [addresses[0] + i * BLOCK_BYTES for i in range(len(BLOCK_IDS))]
    assert addresses[0] not in decode_engine._registered


async def test_a_request_or_block_never_leased_gets_nothing(owner, decode_engine):
    async with owner.client() as client:
        for request_id, block_ids, error in [("r-never", BLOCK_IDS, LeaseExpired), ("r1", [7, 99], BlockNotFound)]:
            with pytest.raises(error):
                await client.lease_blocks(LAYOUT, (), "", LeaseVia.TRANSFER_ENGINE, request_id=request_id,
                                          block_ids=block_ids)
        with pytest.raises(DataPlaneError, match="transfer engines only"):  # by id, but for shared memory
            await client.lease_blocks(LAYOUT, (), "", LeaseVia.SHARED_MEMORY, request_id="r1", block_ids=BLOCK_IDS)
        owner.provider.end_lease("r1")  # Release or expiry on the owner: nothing to lease any more
        with pytest.raises(LeaseExpired):
            await TransferEngineReads(engine=decode_engine).get_held(client, "r1", BLOCK_IDS, LAYOUT)
    with pytest.raises(DataPlaneAuthError):  # the session and addresses are told only past the handshake
        async with owner.client(generate_secret()) as stranger:
            await stranger.lease_blocks(LAYOUT, (), "", LeaseVia.TRANSFER_ENGINE, request_id="r1",
                                        block_ids=BLOCK_IDS)
    assert owner.exports.num_free_slots == owner.exports.num_slots


def _read_slot(engine: TransferEngine, lease, i: int) -> bytes:
    """Grant i's bytes as they are in the owner's region now (a raw engine read, no seq or checksum check)."""
    region, grant = lease.remote_region, lease.slots[i]
    out = np.zeros(grant.size, np.uint8)
    engine.register_buffer(out)
    try:
        engine.read(region.session_id, [Transfer(out.ctypes.data, region.slots_address + grant.slot * region.slot_bytes,
                                                 grant.size)])
    finally:
        engine.unregister(out.ctypes.data)
    return out.tobytes()


async def test_leased_slots_are_not_reused_until_release(owner, decode_engine):
    others = [os.urandom(BLOCK_BYTES) for _ in BLOCK_IDS]
    owner.provider.add_lease("r2", BLOCK_IDS, others)
    reads = TransferEngineReads(engine=decode_engine)

    async def lease(request_id: str, block_ids: list[int]):
        return await client.lease_blocks(LAYOUT, (), "", LeaseVia.TRANSFER_ENGINE, request_id=request_id,
                                         block_ids=block_ids)

    async with owner.client() as client:
        first, second = await lease("r1", BLOCK_IDS), await lease("r2", BLOCK_IDS)
        assert not {g.slot for g in first.slots} & {g.slot for g in second.slots}  # 8 slots: all taken now
        with pytest.raises(DataPlaneError, match="export slots free"):  # full: refused, nothing overwritten
            await lease("r1", [7])
        assert [_read_slot(decode_engine, first, i) for i in range(len(BLOCK_IDS))] == PAYLOADS
        assert [bytes(b) for b in reads._copy(decode_engine, first, None)] == PAYLOADS  # seq and checksum hold

        await client.release_lease(first.lease_id)  # the reader is done: its slots may be taken again
        third = await lease("r2", BLOCK_IDS)
        assert {g.slot for g in third.slots} == {g.slot for g in first.slots}
        with pytest.raises(TornRead):  # a reader still holding the ended lease: the rewrite is seen, never served
            reads._copy(decode_engine, first, None)
        assert [bytes(b) for b in reads._copy(decode_engine, second, None)] == others  # untouched meanwhile

        owner.provider.end_lease("r2")  # the request's lease ends (Release on NATS, expiry): its export leases too
        assert owner.exports.num_free_slots == owner.exports.num_slots
        owner.provider.add_lease("r3", range(1, 9), [os.urandom(BLOCK_BYTES) for _ in range(8)])
        await lease("r3", list(range(1, 9)))  # every slot rewritten
        for ended in (second, third):
            with pytest.raises(TornRead):
                reads._copy(decode_engine, ended, None)

