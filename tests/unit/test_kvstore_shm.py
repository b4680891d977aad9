"""The store's RAM tier in shared memory (deepinfer.kvcache.shm): slots under a seqlock, leases that keep an evicted
block's slot from reuse, host identity, and the store serving the same bytes through a lease as through a get."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from deepinfer.dataplane import BlockNotFound, ChecksumError, DataPlaneError
from deepinfer.kvcache.shm import ShmRamTier, SlotReader, SlotRef, SlotRegion, TornRead, key_digest
from tests.kvstore_harness import LAYOUT, FakeClock, KiB, hashes, open_store, payload

SLOT = 8 * KiB
SIZE = 5 * KiB


def _read(reader: SlotReader, ref: SlotRef) -> bytes:
    out = np.empty(ref.size, np.uint8)
    reader.read_into(ref, out)
    return out.tobytes()


class Clock:
    """Monotonic seconds moved by hand (lease times)."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _tier(tmp_path: Path, num_slots: int, clock: Clock | None = None) -> ShmRamTier:
    return ShmRamTier(num_slots * SLOT, tmp_path, SLOT, lease_s=30.0, clock=clock or Clock())


def test_a_slot_reads_back_whole_and_a_rewritten_slot_is_refused(tmp_path):
    region = SlotRegion(tmp_path, num_slots=2, slot_bytes=SLOT)
    reader = SlotReader(region.path)
    try:
        first = region.write(1, payload("a", SIZE), key_digest(LAYOUT, b"a"))
        assert first.seq == 2 and first.size == SIZE
        assert _read(reader, first) == payload("a", SIZE)
        second = region.write(1, payload("b", SIZE), key_digest(LAYOUT, b"b"))
        assert second.seq == 4
        with pytest.raises(TornRead):
            _read(reader, first)  # the lease's seq is gone: never the new block's bytes under the old name
        assert _read(reader, second) == payload("b", SIZE)
        with pytest.raises(ChecksumError):
            _read(reader, SlotRef(1, second.seq, SIZE, second.checksum ^ 1, second.key_digest))
    finally:
        reader.close()
        region.close()
    assert not region.path.exists()  # unlinked on close


def test_the_region_file_is_private_and_read_only_for_readers(tmp_path):
    region = SlotRegion(tmp_path, num_slots=1, slot_bytes=SLOT)
    reader = SlotReader(region.path)
    try:
        assert region.path.stat().st_mode & 0o777 == 0o600
        assert not reader.slots.flags.writeable
        with pytest.raises(ValueError):
            reader.slots[0, 0] = 1
    finally:
        reader.close()
        region.close()


def _rewrite(path: str, versions: list[bytes], num_writes: int, started) -> None:
    """In another process: rewrite slot 0 of the region at `path` with alternating whole versions."""
    import mmap
    import os

    from deepinfer.kvcache.shm import region as r

    fd = os.open(path, os.O_RDWR)
    size = os.fstat(fd).st_size
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    writer = object.__new__(r.SlotRegion)  # the shard's own write(), from a second process on the same file
    writer.layout = r.RegionLayout(1, SLOT)
    writer._mapped = r._Mapped(mapping, writer.layout, writable=True)
    started.set()
    for i in range(num_writes):
        writer.write(0, versions[i % len(versions)], key_digest(LAYOUT, b"hot"))


def test_a_block_being_rewritten_is_never_returned_torn(tmp_path):
    # A writer process rewrites one slot as fast as it can with three whole versions; the reader reads it
    # under whatever seq it sees. Every read either fails (TornRead/ChecksumError: the caller falls back) or is
    # exactly one whole version. No timing assertions: only that both outcomes are classified.
    versions = [payload(f"v{i}", SLOT) for i in range(3)]
    region = SlotRegion(tmp_path, num_slots=1, slot_bytes=SLOT)
    first = region.write(0, versions[0], key_digest(LAYOUT, b"hot"))
    reader = SlotReader(region.path)
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Event()
    writer = ctx.Process(target=_rewrite, args=(str(region.path), versions, 200_000, started))
    writer.start()
    num_whole = num_refused = 0
    try:
        assert started.wait(60)
        out = np.empty(SLOT, np.uint8)
        while writer.is_alive() or num_whole + num_refused < 2000:
            ref = reader.current(0)
            if ref is None:
                continue  # being written: a reader with a lease never sees this (its seq is even)
            try:
                reader.read_into(ref, out)
            except (TornRead, ChecksumError):
                num_refused += 1
                continue
            assert out.tobytes() in versions
            num_whole += 1
        writer.join(60)
        assert writer.exitcode == 0
    finally:
        if writer.is_alive():
            writer.kill()
        reader.close()
        region.close()
    assert num_whole > 0
    assert first.seq == 2


def test_an_evicted_blocks_slot_is_not_reused_while_leased(tmp_path):
    clock = Clock()
    tier = _tier(tmp_path, num_slots=2, clock=clock)
    reader = SlotReader(tier.region.path)
    a, b, c, d = ((LAYOUT, h) for h in hashes("a", "b", "c", "d"))
    try:
        tier.put(a, payload("a", SIZE), 1.0)
        tier.put(b, payload("b", SIZE), 2.0)
        lease = tier.lease([a])
        assert lease is not None
        (ref_a,) = lease.refs
        assert tier.remove(a)  # evicted from the index (disk eviction, expiry) while a reader holds the lease
        assert a not in tier
        assert tier.put(c, payload("c", SIZE), 3.0) == [b]  # a's slot is retired: b's is the one freed
        assert tier.get(c).ref.slot != ref_a.slot
        assert tier.put(d, payload("d", SIZE), 4.0) == [c]
        assert tier.get(d).ref.slot != ref_a.slot
        assert _read(reader, ref_a) == payload("a", SIZE)  # still the leased bytes
        assert tier.release(lease.lease_id)
        assert not tier.release(lease.lease_id)
        tier.put(a, payload("a2", SIZE), 5.0)  # the slot is free again: reused, and the old lease fails
        assert tier.get(a).ref.slot == ref_a.slot
        with pytest.raises(TornRead):
            _read(reader, ref_a)
    finally:
        reader.close()
        tier.close()


def test_lru_eviction_skips_leased_blocks_and_leases_end_by_time(tmp_path):
    clock = Clock()
    tier = _tier(tmp_path, num_slots=2, clock=clock)
    a, b, c, d = ((LAYOUT, h) for h in hashes("a", "b", "c", "d"))
    try:
        tier.put(a, payload("a", SIZE), 1.0)
        tier.put(b, payload("b", SIZE), 2.0)
        lease = tier.lease([a, b])
        assert tier.put(c, payload("c", SIZE), 3.0) == []  # every block leased: c is not held (it is on disk)
        assert c not in tier and tier.keys() == [a, b]
        assert tier.lease([a, c]) is None  # all or nothing
        clock.now_s += 31.0  # past lease_s: a reader that died does not pin slots for ever
        assert tier.put(c, payload("c", SIZE), 4.0) == [a]
        assert tier.num_leases == 0 and not tier.release(lease.lease_id)
        tier.lease([c])
        assert tier.put(d, payload("d", SIZE), 5.0) == [b]  # a leased LRU block stays, the next one goes
        assert tier.put(a, payload("a", 2 * SLOT), 6.0) == []  # larger than a slot: not held
        assert tier.keys() == [c, d] and tier.used_bytes == 2 * SIZE
    finally:
        tier.close()


def test_a_lease_serves_the_bytes_a_get_serves_from_ram_and_from_disk(tmp_path):
    store, _ = open_store(tmp_path, FakeClock(), ram_bytes=3 * SLOT, shm_dir=tmp_path, shm_slot_bytes=SLOT)
    names = ["a", "b", "c"]
    try:
        assert store.shm_enabled
        store.write_blocks(LAYOUT, hashes(*names, "d"), [payload(n, SIZE) for n in [*names, "d"]])  # RAM: b, c, d
        lease = store.lease_blocks(LAYOUT, hashes(*names), store.host_id)  # a is promoted from disk
        reader = SlotReader(lease.region_path)
        got = [_read(reader, ref) for ref in lease.refs]
        assert got == [payload(n, SIZE) for n in names]
        assert got == [bytes(p) for p in store.read_blocks("", [], hashes(*names), LAYOUT)]
        store.release_lease(lease.lease_id)
        reader.close()
    finally:
        store.close()


def test_a_lease_is_refused_to_another_host_and_without_the_region(tmp_path):
    store, _ = open_store(tmp_path, FakeClock(), shm_dir=tmp_path, shm_slot_bytes=SLOT)
    try:
        store.write_blocks(LAYOUT, hashes("a"), [payload("a", SIZE)])
        with pytest.raises(DataPlaneError, match="readers on host"):
            store.lease_blocks(LAYOUT, hashes("a"), "another-host/boot")
        with pytest.raises(BlockNotFound):
            store.lease_blocks(LAYOUT, hashes("missing"), store.host_id)
    finally:
        store.close()
    plain, _ = open_store(tmp_path / "plain", FakeClock())
    try:
        assert not plain.shm_enabled
        with pytest.raises(DataPlaneError, match="shared memory"):
            plain.lease_blocks(LAYOUT, hashes("a"), plain.host_id)
    finally:
        plain.close()


def test_a_restart_keeps_every_block_on_disk_and_makes_a_new_region(tmp_path):
    names = [f"b{i}" for i in range(6)]
    store, _ = open_store(tmp_path, FakeClock(), ram_bytes=2 * SLOT, shm_dir=Path("/dev/shm"), shm_slot_bytes=SLOT)
    store.write_blocks(LAYOUT, hashes(*names), [payload(n, SIZE) for n in names])
    old_region = store.lease_blocks(LAYOUT, hashes("b5"), store.host_id).region_path
    store.close()
    assert not Path(old_region).exists()
    store, _ = open_store(tmp_path, FakeClock(), ram_bytes=2 * SLOT, shm_dir=Path("/dev/shm"), shm_slot_bytes=SLOT)
    try:
        assert [bytes(p) for p in store.read_blocks("", [], hashes(*names), LAYOUT)] == [
            payload(n, SIZE) for n in names
        ]
        lease = store.lease_blocks(LAYOUT, hashes("b0", "b1"), store.host_id)
        assert lease.region_path != old_region
        reader = SlotReader(lease.region_path)
        assert [_read(reader, ref) for ref in lease.refs] == [payload("b0", SIZE), payload("b1", SIZE)]
        reader.close()
    finally:
        store.close()


def _open_and_die(disk_dir: str, told: str) -> None:
    """In another process: open a store with a shared-memory tier, say where its region is, exit without closing."""
    import os

    from deepinfer.kvcache.store import KvStore, StoreSettings

    store = KvStore(StoreSettings(ram_bytes=2 * SLOT, disk_dir=Path(disk_dir), shm_dir=Path("/dev/shm"),
                                  shm_slot_bytes=SLOT))
    Path(told).write_text(str(store._ram.region.path))
    os._exit(0)  # as kill -9: nothing unlinks the region


def test_the_next_owner_of_the_directory_unlinks_a_killed_stores_region(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    dead = ctx.Process(target=_open_and_die, args=(str(tmp_path / "store"), str(tmp_path / "told")))
    dead.start()
    dead.join(60)
    left = Path((tmp_path / "told").read_text())
    assert left.exists()  # the tmpfs keeps a killed shard's pages ...
    store, _ = open_store(tmp_path, FakeClock(), ram_bytes=2 * SLOT, shm_dir=Path("/dev/shm"), shm_slot_bytes=SLOT)
    try:
        assert not left.exists()  # ... until the directory's next owner opens it
    finally:
        store.close()
