"""The P/D handoff through Mooncake Transfer Engine, loopback TCP: a prefill-side provider's export slots
(deepinfer.worker.handoff_exports, registered with one engine) read by a decode-side reader
(TransferEngineReads.get_held, another engine) are byte-identical to the data-plane get; a request or block never
leased gets nothing; leased slots are not reused until release or the request's lease ends; then the prefill and
decode handlers on a real nats-server: the same tokens as one engine through the engine, and through the data plane
when the engine fails.

Skips, saying why, without the `transfer-engine` extra or libibverbs1 (.ci/run installs both)."""

from __future__ import annotations

import asyncio
import logging
import os

import numpy as np
import pytest
from opentelemetry.trace import NoOpTracer

from deepinfer.config import DecodeSettings, PrefillSettings
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
    TransferFailed,
    availability,
    buffer_address,
)
from deepinfer.kvcache.client.remote import TransferEngineReads
from deepinfer.kvcache.shm.region import TornRead
from deepinfer.sampling.params import SamplingParams
from deepinfer.service import ServiceContext
from deepinfer.telemetry import new_registry
from deepinfer.testing.dataplane import InMemoryBlockProvider
from deepinfer.worker.handoff_exports import HandoffExports
from services.decode.handler import DecodeHandler
from services.prefill.handler import PrefillHandler
from tests.integration.test_workers import (  # the data-plane handoff's fixtures and helpers
    GREEDY,
    _model_token,  # noqa: F401
    common,
    reference,
    run_request,
    start,
    tiny_dir,  # noqa: F401
)

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


# -- the prefill and decode handlers --------------------------------------------------------------------------------


@pytest.fixture
async def make_workers(nats_server, tiny_dir, tmp_path, bus):  # noqa: F811
    """A prefill worker with transfer_engine on and a decode worker with the given kv_transport."""
    started = []

    async def make(kv_transport: str):
        shared = common(nats_server, tiny_dir, tmp_path)
        prefill = PrefillHandler(ServiceContext("prefill", PrefillSettings(
            common=shared, worker_id="prefill-t", block_size=4, data_plane_port=0, internal_port=0,
            transfer_engine=True, transfer_engine_export_bytes=1 << 20), bus, new_registry(), NoOpTracer()))
        decode = DecodeHandler(ServiceContext("decode", DecodeSettings(
            common=shared, worker_id="decode-t", block_size=4, internal_port=0, kv_transport=kv_transport),
            bus, new_registry(), NoOpTracer()))
        await asyncio.gather(start(prefill), start(decode))
        started.append((prefill, decode))
        return prefill, decode

    yield make
    for prefill, decode in started:
        await asyncio.gather(prefill.close(), decode.close())


async def _released(prefill) -> None:
    for _ in range(100):
        if not prefill._leases and prefill._exports.num_free_slots == prefill._exports.num_slots:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"still held: {prefill._leases}, {prefill._exports.num_free_slots} export slots free")


def _pulls(decode, via: str) -> float:
    return decode._pulls.labels(via)._value.get()


async def test_the_handoff_through_the_engine_equals_one_engine(make_workers, bus, tiny_dir):  # noqa: F811
    prefill, decode = await make_workers("mooncake")  # one machine standing in for two
    accepted, tokens = await run_request(bus, "prefill-t", GREEDY, "r-te")
    assert tokens == reference(tiny_dir, SamplingParams(**GREEDY.model_dump(exclude={"v"})))
    assert decode._requests.labels("pulled")._value.get() == 1
    assert _pulls(decode, "transfer_engine") == 1 and _pulls(decode, "data_plane") == 0
    assert decode._handoff_reads.num_blocks == 6  # 21 prompt tokens in blocks of 4
    await _released(prefill)


async def test_a_failing_engine_falls_back_to_the_data_plane_get(make_workers, bus, tiny_dir, monkeypatch,  # noqa: F811
                                                                  caplog):
    prefill, decode = await make_workers("mooncake")

    def broken(self, session_id, transfers):
        raise TransferFailed("transfer engine: read failed (code -1)")

    monkeypatch.setattr(TransferEngine, "read", broken)
    want = reference(tiny_dir, SamplingParams(**GREEDY.model_dump(exclude={"v"})))
    with caplog.at_level(logging.DEBUG, logger="services.decode.handler"):
        for request_id in ("r-fallback-1", "r-fallback-2"):
            accepted, tokens = await run_request(bus, "prefill-t", GREEDY, request_id)
            assert tokens == want
    assert decode._requests.labels("pulled")._value.get() == 2
    assert _pulls(decode, "transfer_engine_fallback") == 2 and _pulls(decode, "data_plane") == 2
    assert _pulls(decode, "transfer_engine") == 0
    said = [r for r in caplog.records if "through its transfer engine failed" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG]  # why, once
    await _released(prefill)  # the failed reader's export lease was released too


async def test_auto_keeps_a_same_host_handoff_on_the_data_plane(make_workers, bus, tiny_dir):  # noqa: F811
    prefill, decode = await make_workers("auto")
    accepted, tokens = await run_request(bus, "prefill-t", GREEDY, "r-auto")
    assert _pulls(decode, "data_plane") == 1 and _pulls(decode, "transfer_engine") == 0
    await _released(prefill)
