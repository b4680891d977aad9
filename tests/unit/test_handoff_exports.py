"""A prefill worker's handoff export slots (deepinfer.worker.handoff_exports): which slots a lease takes, that a
leased slot is never taken again until release or the request's lease ends, and that the region is registered
once and unregistered before it is unmapped. Bookkeeping only: the engine is a recording fake."""

from __future__ import annotations

import os

import pytest

from deepinfer.dataplane.frames import checksum
from deepinfer.kvcache.shm.region import PAGE
from deepinfer.worker.handoff_exports import HandoffExports, NoExportRoom, export_digest

BLOCK = 5000  # two pages a slot


class FakeEngine:
    """Records what is registered; names itself like a P2PHANDSHAKE session."""

    session_id = "10.0.0.7:15000"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def register(self, address: int, length: int) -> None:
        self.calls.append(("register", address))

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))


def _payloads(n: int) -> list[bytes]:
    return [os.urandom(BLOCK) for _ in range(n)]


def test_a_lease_takes_free_slots_in_order_and_names_each_block():
    engine = FakeEngine()
    exports = HandoffExports(engine, capacity_bytes=4 * 2 * PAGE + 100, block_nbytes=BLOCK)
    assert (exports.num_slots, exports.remote_region.slot_bytes) == (4, 2 * PAGE)
    assert engine.calls == [("register", exports.region.address)]
    assert exports.remote_region.session_id == engine.session_id
    payloads = _payloads(2)
    lease = exports.lease("r1", [9, 4], "layout", payloads)
    assert [ref.slot for ref in lease.refs] == [0, 1]
    assert [ref.checksum for ref in lease.refs] == [checksum(p) for p in payloads]
    assert [ref.key_digest for ref in lease.refs] == [export_digest("layout", "r1", 9), export_digest("layout", "r1", 4)]
    assert [bytes(exports.region.view(ref.slot, ref.size)) for ref in lease.refs] == payloads
    assert lease.region_path == "" and lease.remote_region is exports.remote_region


def test_leased_slots_are_taken_again_only_after_release_or_the_request_ends():
    exports = HandoffExports(FakeEngine(), capacity_bytes=4 * 2 * PAGE, block_nbytes=BLOCK)
    first = exports.lease("r1", [1, 2], "l", _payloads(2))
    second = exports.lease("r2", [1], "l", _payloads(1))
    assert [ref.slot for ref in second.refs] == [2]
    with pytest.raises(NoExportRoom, match="2 blocks to export, 1 of 4"):
        exports.lease("r3", [1, 2], "l", _payloads(2))
    assert exports.num_free_slots == 1  # a refused lease takes nothing
    assert exports.release(first.lease_id) and not exports.release(first.lease_id)
    third = exports.lease("r3", [1, 2, 3], "l", _payloads(3))
    assert sorted(ref.slot for ref in third.refs) == [0, 1, 3]
    assert {ref.slot: ref.seq for ref in third.refs}[0] > first.refs[0].seq  # rewritten: a later seq
    assert exports.end_request("r3") == 1 and exports.end_request("r3") == 0
    assert exports.num_free_slots == 3


def test_a_block_larger_than_a_slot_is_refused():
    exports = HandoffExports(FakeEngine(), capacity_bytes=2 * 2 * PAGE, block_nbytes=BLOCK)
    with pytest.raises(NoExportRoom, match="larger than"):
        exports.lease("r1", [1], "l", [os.urandom(2 * PAGE + 1)])
    with pytest.raises(ValueError, match="hold no"):
        HandoffExports(FakeEngine(), capacity_bytes=PAGE, block_nbytes=BLOCK)


def test_close_unregisters_before_it_unmaps():
    engine = FakeEngine()
    exports = HandoffExports(engine, capacity_bytes=2 * PAGE, block_nbytes=BLOCK)
    address = exports.region.address
    exports.close()
    assert engine.calls == [("register", address), ("unregister", address)]
