"""SnapshotPages: one cut per snapshot, pages from the frozen copy, a fresh cut when the asked one is gone."""

from __future__ import annotations

from deepinfer.protocol import SnapshotRequest
from deepinfer.worker import kv_snapshot
from deepinfer.worker.kv_snapshot import SnapshotPages


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


async def test_pages_come_from_one_frozen_cut_and_a_lost_one_is_cut_again():
    now = {"s": 0.0}
    state = {"seq": 4, "hashes": [h(i) for i in range(5)]}
    cuts: list[int] = []

    async def cut() -> tuple[int, list[bytes], list[bytes]]:
        cuts.append(state["seq"])
        return state["seq"], list(state["hashes"]), []

    pages = SnapshotPages("w1", "boot", cut, clock=lambda: now["s"])
    first = await pages.page(SnapshotRequest(page_size=2))
    assert (first.seq, first.block_hashes, first.next_cursor, first.cursor, first.epoch) == (
        4, [h(0), h(1)], 2, 0, "boot",
    )
    state.update(seq=5, hashes=[h(9)])  # the cache moves on while the reader pages
    second = await pages.page(SnapshotRequest(cursor=2, seq=4, page_size=2))
    last = await pages.page(SnapshotRequest(cursor=4, seq=4, page_size=2))
    assert [second.block_hashes, last.block_hashes] == [[h(2), h(3)], [h(4)]]
    assert (second.seq, last.seq, last.next_cursor) == (4, 4, None)
    assert cuts == [4]
    now["s"] = kv_snapshot.FROZEN_TTL_S + 1  # the frozen cut expired: a fresh one from cursor 0
    again = await pages.page(SnapshotRequest(cursor=2, seq=4, page_size=2))
    assert (again.seq, again.cursor, again.block_hashes, again.next_cursor) == (5, 0, [h(9)], None)
    assert cuts == [4, 5]
    for seq in range(6, 6 + kv_snapshot.MAX_FROZEN + 1):  # only the newest MAX_FROZEN cuts are kept
        state["seq"] = seq
        await pages.page(SnapshotRequest())
    state["seq"] = 99
    assert (await pages.page(SnapshotRequest(cursor=1, seq=6))).seq == 99  # cut 6 was dropped
    assert (await pages.page(SnapshotRequest(cursor=0, seq=7, page_size=1))).seq == 99  # cursor 0: always fresh


async def test_pages_run_over_the_device_blocks_then_the_host_tier_blocks():
    async def cut() -> tuple[int, list[bytes], list[bytes]]:
        return 3, [h(0), h(1), h(2)], [h(7), h(8)]

    pages = SnapshotPages("w1", "boot", cut)
    got = [await pages.page(SnapshotRequest(page_size=2))]
    while got[-1].next_cursor is not None:
        got.append(await pages.page(SnapshotRequest(cursor=got[-1].next_cursor, seq=3, page_size=2)))
    assert [(p.block_hashes, p.host_block_hashes) for p in got] == [
        ([h(0), h(1)], []), ([h(2)], [h(7)]), ([], [h(8)]),
    ]
