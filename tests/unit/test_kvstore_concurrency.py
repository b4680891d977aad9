"""Threads (as the data-plane server runs a plain provider): puts, gets, compaction and expiry of shared keys."""

from __future__ import annotations

import sys
import threading

from deepinfer.dataplane import BlockNotFound
from deepinfer.kvcache.store import StoreEventKind
from tests.kvstore_harness import LAYOUT, OTHER_LAYOUT, FakeClock, KiB, hashes, open_store, payload

SIZE = 64 * KiB
NAMES = [f"k{i}" for i in range(12)]


def _run(threads: list[threading.Thread]) -> None:
    """Start and join the threads with the GIL handed over every microsecond (CPython's default is 5 ms), so
    they interleave inside the store's methods, not only at its I/O."""
    interval_s = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
            assert not thread.is_alive()
    finally:
        sys.setswitchinterval(interval_s)


def test_concurrent_put_and_get_of_shared_keys_never_serve_wrong_bytes(tmp_path):
    # RAM holds 3 blocks and the disk 8 records: reads race promotions, RAM and disk evictions and compaction.
    store, _ = open_store(
        tmp_path, FakeClock(), ram_bytes=3 * SIZE, disk_bytes=8 * (SIZE + KiB), segment_bytes=4 * (SIZE + KiB)
    )
    expected = {(LAYOUT, n): payload(n, SIZE) for n in NAMES} | {
        (OTHER_LAYOUT, n): payload("o" + n, SIZE) for n in NAMES
    }
    hot = (LAYOUT, "hot")  # put by every writer and read by every reader, all the time
    expected[hot] = payload("hot", SIZE)
    store.write_blocks(LAYOUT, hashes("hot"), [expected[hot]])
    failures: list[str] = []
    served = {"hot": 0, "other": 0, "misses": 0}

    def writer(seed: int) -> None:
        for i in range(200):
            layout, name = (LAYOUT, OTHER_LAYOUT)[i % 2], NAMES[(i * (seed + 1)) % len(NAMES)]
            store.write_blocks(layout, hashes(name), [expected[(layout, name)]])
            store.write_blocks(LAYOUT, hashes("hot"), [expected[hot]])

    def reader(seed: int) -> None:
        for i in range(400):
            layout, name = (LAYOUT, OTHER_LAYOUT)[(i + seed) % 2], NAMES[(i * (seed + 3)) % len(NAMES)]
            if i % 2:
                layout, name = hot
            try:
                [got] = store.read_blocks("", [], hashes(name), layout)
            except BlockNotFound:
                served["misses"] += 1
                continue
            served["hot" if (layout, name) == hot else "other"] += 1
            if got != expected[(layout, name)]:
                failures.append(f"{layout}/{name}: wrong bytes")

    def maintainer() -> None:
        for _ in range(100):
            store.compact_step()
            store.expire()
            store.has_blocks(LAYOUT, hashes(*NAMES))

    _run(
        [threading.Thread(target=writer, args=(s,)) for s in range(2)]
        + [threading.Thread(target=reader, args=(s,)) for s in range(3)]
        + [threading.Thread(target=maintainer)]
    )
    assert failures == []
    # The race was real: the hot key was read 600 times while being put (each thread uses it at least every other
    # op, so at most 5 keys are ever more recent: never the LRU one of 8), and rotating keys were found too.
    assert served["hot"] == 600 and served["other"] > 0
    store.compact()
    stats = store.stats()
    assert stats.disk_live_bytes <= 8 * (SIZE + KiB) and stats.num_ram_blocks <= 3
    store.close()
    reopened, _ = open_store(tmp_path, FakeClock(), ram_bytes=0, disk_bytes=8 * (SIZE + KiB))
    for layout in (LAYOUT, OTHER_LAYOUT):  # whatever survived the restart is whole
        held = [
            n
            for n, present in zip(NAMES, reopened.has_blocks(layout, hashes(*NAMES)), strict=True)
            if present
        ]
        assert reopened.read_blocks("", [], hashes(*held), layout) == [expected[(layout, n)] for n in held]
    reopened.close()


def test_simultaneous_puts_of_one_key_store_it_once(tmp_path):
    num_threads = 8
    store, _ = open_store(tmp_path, FakeClock())
    barrier = threading.Barrier(num_threads)

    def put() -> None:
        barrier.wait()
        store.write_blocks(LAYOUT, hashes("same"), [payload("same")])

    _run([threading.Thread(target=put) for _ in range(num_threads)])
    assert [e.kind for e in store.take_events()] == [StoreEventKind.STORED]
    stats = store.stats()
    assert stats.num_disk_blocks == 1 and stats.disk_file_bytes == stats.disk_live_bytes
    assert store.read_blocks("", [], hashes("same"), LAYOUT) == [payload("same")]
    store.close()
