"""The global KV index: (layout, block hash) → holders {worker or store shard, tier}. Pure bookkeeping, no I/O.

Fed by each worker's KvEventBatch stream and by the store shards' KvStoreEventBatch streams:

- a worker is indexed once its heartbeat named its layout (`observe_worker`); until then its events are ignored
  (the snapshot taken when it joins covers them);
- worker batches apply in seq order: an old seq is a duplicate (ignored), a skipped seq is a *gap*, and a new
  `epoch` (boot id) is a restart. Both drop the worker's entries and ask for a snapshot (the caller pages it with
  `begin_snapshot` / `apply_page` / `end_snapshot`); batches arriving meanwhile are held and those after the
  snapshot's seq applied on top;
- store shards have no snapshot: a gap in a shard's stream drops that shard's entries and the stream goes on;
- a worker or shard that leaves is removed with all its entries (`remove_worker`, `remove_store_shard`).

Bounded memory: at most `max_entries` (holder, block) entries. Each holder keeps its blocks in recency order
(stored, or credited by a routing decision via `touch`); past the cap, the holder with the most entries loses its
least recent block. Forgetting a block only makes the router underestimate a hit, never route to a miss twice.

Each holder has a slot; per (layout, hash) one int holds two bits per slot (device, lower tier), so a prefix walk
over many candidates is a few integer operations per block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from deepinfer.defaults import DEFAULT_KV_INDEX_MAX_ENTRIES
from deepinfer.protocol import KvEventBatch, KvEventKind, KvStoreEventBatch, KvTier, SnapshotPage

#: Batches held per worker while its snapshot is paged; more restarts the snapshot.
MAX_PENDING_BATCHES = 4096

DEVICE_BIT, LOWER_BIT = 1, 2  # per-slot tier bits: device, or host/disk/store


class SyncState(Enum):
    """Where a worker's entries stand."""

    LIVE = "live"  # events apply in seq order
    NEEDS_SNAPSHOT = "needs_snapshot"  # entries dropped, a snapshot must be paged
    SNAPSHOT = "snapshot"  # pages arriving; batches held


@dataclass
class Holder:
    """One worker, or one (store shard, layout): its blocks in recency order (oldest first) with tier bits."""

    key: str
    slot: int
    layout_id: str
    is_store: bool = False
    blocks: dict[bytes, int] = field(default_factory=dict)
    epoch: str = ""
    seq: int = 0
    state: SyncState = SyncState.NEEDS_SNAPSHOT
    snapshot_seq: int | None = None
    pending: list[KvEventBatch] = field(default_factory=list)


@dataclass
class PrefixMatch:
    """A candidate's cached prefix of a request: blocks held on its device, then in a lower tier or the store."""

    device_blocks: int = 0
    lower_blocks: int = 0
    store_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        """Length of the cached prefix in blocks, whatever the tier."""
        return self.device_blocks + self.lower_blocks + self.store_blocks


class KvIndex:
    """See the module docstring."""

    def __init__(self, max_entries: int = DEFAULT_KV_INDEX_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._blocks: dict[str, dict[bytes, int]] = {}  # layout -> hash -> slot bits
        self._holders: dict[str, Holder] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._store_seq: dict[str, int] = {}
        self.num_entries = 0
        self.num_evicted = 0
        self.num_gaps = 0
        self.num_epochs = 0

    # -- workers ----------------------------------------------------------------------------------------------

    def observe_worker(self, worker_id: str, layout_id: str, epoch: str) -> bool:
        """A heartbeat: index the worker under its layout; True when a snapshot must be paged (new worker,
        new epoch or layout, or one still owed)."""
        holder = self._holders.get(worker_id)
        if holder is not None and (holder.epoch != epoch or holder.layout_id != layout_id):
            self.num_epochs += holder.epoch != epoch
            self.remove_worker(worker_id)
            holder = None
        if holder is None:
            holder = self._add_holder(worker_id, layout_id)
            holder.epoch = epoch
        return holder.state is SyncState.NEEDS_SNAPSHOT

    def apply_batch(self, batch: KvEventBatch) -> bool:
        """One worker batch; True when a snapshot must be paged (a gap or a new epoch)."""
        holder = self._holders.get(batch.worker_id)
        if holder is None or holder.is_store:
            return False  # not a member yet: the snapshot taken when it joins covers this
        if batch.epoch != holder.epoch:
            self.num_epochs += 1
            self._reset(holder)
            holder.epoch = batch.epoch
            return True
        if holder.state is not SyncState.LIVE:
            return self._hold(holder, batch)
        if batch.seq <= holder.seq:
            return False  # duplicate or replayed
        if batch.seq != holder.seq + 1:
            self.num_gaps += 1
            self._reset(holder)
            return True
        self._apply_events(holder, batch)
        return False

    def begin_snapshot(self, worker_id: str) -> bool:
        """Start paging a snapshot: the worker's entries are dropped; False for an unknown worker."""
        holder = self._holders.get(worker_id)
        if holder is None or holder.is_store:
            return False
        self._drop_entries(holder)
        holder.state, holder.snapshot_seq = SyncState.SNAPSHOT, None
        return True

    def apply_page(self, page: SnapshotPage) -> bool:
        """One snapshot page; False when it does not belong to the snapshot being paged (start over)."""
        holder = self._holders.get(page.worker_id)
        if holder is None or holder.state is not SyncState.SNAPSHOT or page.epoch != holder.epoch:
            return False
        if holder.snapshot_seq is None:
            if page.cursor != 0:
                return False
            holder.snapshot_seq = page.seq
        elif page.seq != holder.snapshot_seq:
            return False
        for block_hash in page.block_hashes:
            self._store(holder, bytes(block_hash), DEVICE_BIT)
        for block_hash in page.host_block_hashes:  # the worker's host-memory tier
            self._store(holder, bytes(block_hash), LOWER_BIT)
        return True

    def end_snapshot(self, worker_id: str) -> bool:
        """The last page arrived: apply the held batches past the snapshot's seq. False when they have a gap
        (or nothing was paged): the entries are dropped and a snapshot is owed again."""
        holder = self._holders.get(worker_id)
        if holder is None or holder.state is not SyncState.SNAPSHOT or holder.snapshot_seq is None:
            return False
        pending, holder.pending = sorted(holder.pending, key=lambda b: b.seq), []
        holder.seq, holder.state = holder.snapshot_seq, SyncState.LIVE
        for batch in pending:
            if batch.seq <= holder.seq:
                continue
            if batch.seq != holder.seq + 1:
                self.num_gaps += 1
                self._reset(holder)
                return False
            self._apply_events(holder, batch)
        return True

    def abort_snapshot(self, worker_id: str) -> None:
        """Paging failed (timeout, bad page): entries dropped, a snapshot is owed."""
        holder = self._holders.get(worker_id)
        if holder is not None and not holder.is_store:
            self._reset(holder)

    def sync_state(self, worker_id: str) -> SyncState | None:
        """Where the worker's entries stand; None for a worker not indexed."""
        holder = self._holders.get(worker_id)
        return None if holder is None else holder.state

    def remove_worker(self, worker_id: str) -> None:
        """A worker left: forget it and every entry it had."""
        holder = self._holders.pop(worker_id, None)
        if holder is not None:
            self._drop_entries(holder)
            self._free_slots.append(holder.slot)

    # -- store shards -------------------------------------------------------------------------------------------

    def apply_store_batch(self, batch: KvStoreEventBatch) -> None:
        """One store batch; a gap drops the shard's entries (the store pages no snapshot) and goes on."""
        last_seq = self._store_seq.get(batch.shard)
        if last_seq is not None and batch.seq <= last_seq:
            return
        if last_seq is not None and batch.seq != last_seq + 1:
            self.num_gaps += 1
            self.remove_store_shard(batch.shard)
        self._store_seq[batch.shard] = batch.seq
        key = f"store:{batch.shard}:{batch.layout_id}"
        holder = self._holders.get(key) or self._add_holder(key, batch.layout_id, is_store=True)
        for block_hash in batch.stored_block_hashes:
            self._store(holder, bytes(block_hash), LOWER_BIT)
        for block_hash in (*batch.expired_block_hashes, *batch.evicted_block_hashes):
            self._remove(holder, bytes(block_hash), LOWER_BIT)

    def remove_store_shard(self, shard: str) -> None:
        """A shard left (or lost events): forget its entries under every layout."""
        prefix = f"store:{shard}:"
        for key in [k for k, h in self._holders.items() if h.is_store and k.startswith(prefix)]:
            self.remove_worker(key)
        self._store_seq.pop(shard, None)

    # -- lookups -----------------------------------------------------------------------------------------------

    def match(self, layout_id: str, block_hashes: Sequence[bytes], worker_ids: Iterable[str]) -> dict[str, PrefixMatch]:
        """Each worker's cached prefix of `block_hashes`: per block its own device, its lower tier, else any
        store shard of the layout; the prefix ends at the first block none of those holds. A worker not indexed,
        or not live (its snapshot owed), matches only what the store holds."""
        layout_blocks = self._blocks.get(layout_id, {})
        store_mask = 0
        for holder in self._holders.values():
            if holder.is_store and holder.layout_id == layout_id:
                store_mask |= 3 << (2 * holder.slot)
        matches: dict[str, PrefixMatch] = {}
        live: list[tuple[PrefixMatch, int]] = []
        for worker_id in worker_ids:
            matches[worker_id] = PrefixMatch()
            holder = self._holders.get(worker_id)
            if holder is not None and holder.state is SyncState.LIVE and holder.layout_id == layout_id:
                live.append((matches[worker_id], 2 * holder.slot))
            elif store_mask:
                live.append((matches[worker_id], -1))  # its own blocks unknown (yet): the store's still count
        for block_hash in block_hashes:
            if not live:
                break
            bits = layout_blocks.get(block_hash, 0)
            in_store = bits & store_mask != 0
            still: list[tuple[PrefixMatch, int]] = []
            for prefix, shift in live:
                own = (bits >> shift) & 3 if shift >= 0 else 0
                if own & DEVICE_BIT:
                    prefix.device_blocks += 1
                elif own:
                    prefix.lower_blocks += 1
                elif in_store:
                    prefix.store_blocks += 1
                else:
                    continue
                still.append((prefix, shift))
            live = still
        return matches

    def touch(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        """A decision credited these blocks of the worker: they become its most recent (evicted last)."""
        holder = self._holders.get(worker_id)
        if holder is None:
            return
        for block_hash in block_hashes:
            tiers = holder.blocks.pop(block_hash, None)
            if tiers is None:
                return  # the prefix ends here
            holder.blocks[block_hash] = tiers

    def num_blocks(self) -> int:
        """Distinct (layout, hash) pairs indexed."""
        return sum(len(blocks) for blocks in self._blocks.values())

    def holders(self, layout_id: str, block_hash: bytes) -> dict[str, str]:
        """holder key -> "device" or "lower" for one block (for tests and debugging)."""
        bits = self._blocks.get(layout_id, {}).get(block_hash, 0)
        found = {}
        for key, holder in self._holders.items():
            own = (bits >> (2 * holder.slot)) & 3
            if own:
                found[key] = "device" if own & DEVICE_BIT else "lower"
        return found

    # -- internals ---------------------------------------------------------------------------------------------

    def _add_holder(self, key: str, layout_id: str, is_store: bool = False) -> Holder:
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        state = SyncState.LIVE if is_store else SyncState.NEEDS_SNAPSHOT
        holder = Holder(key=key, slot=slot, layout_id=layout_id, is_store=is_store, state=state)
        self._holders[key] = holder
        return holder

    def _hold(self, holder: Holder, batch: KvEventBatch) -> bool:
        if len(holder.pending) >= MAX_PENDING_BATCHES:
            self._reset(holder)
            return True
        holder.pending.append(batch)
        return False

    def _reset(self, holder: Holder) -> None:
        self._drop_entries(holder)
        holder.state, holder.snapshot_seq, holder.pending, holder.seq = SyncState.NEEDS_SNAPSHOT, None, [], 0

    def _apply_events(self, holder: Holder, batch: KvEventBatch) -> None:
        holder.seq = batch.seq
        for event in batch.events:
            tier_bit = DEVICE_BIT if event.tier is KvTier.DEVICE else LOWER_BIT
            if event.event_kind is KvEventKind.STORED:
                for block_hash in event.block_hashes:
                    self._store(holder, bytes(block_hash), tier_bit)
            elif event.event_kind is KvEventKind.REMOVED:
                for block_hash in event.block_hashes:
                    self._remove(holder, bytes(block_hash), tier_bit)
            else:
                for block_hash in [h for h, tiers in holder.blocks.items() if tiers & tier_bit]:
                    self._remove(holder, block_hash, tier_bit)

    def _store(self, holder: Holder, block_hash: bytes, tier_bit: int) -> None:
        tiers = holder.blocks.pop(block_hash, 0)
        holder.blocks[block_hash] = tiers | tier_bit  # re-inserted: now the most recent
        layout_blocks = self._blocks.setdefault(holder.layout_id, {})
        layout_blocks[block_hash] = layout_blocks.get(block_hash, 0) | (tier_bit << (2 * holder.slot))
        if not tiers:
            self.num_entries += 1
            if self.num_entries > self.max_entries:
                self._evict()

    def _remove(self, holder: Holder, block_hash: bytes, tier_bit: int) -> None:
        tiers = holder.blocks.get(block_hash)
        if tiers is None:
            return
        tiers &= ~tier_bit
        if tiers:
            holder.blocks[block_hash] = tiers
        else:
            del holder.blocks[block_hash]
            self.num_entries -= 1
        self._clear_bit(holder.layout_id, block_hash, tier_bit << (2 * holder.slot))

    def _clear_bit(self, layout_id: str, block_hash: bytes, bit: int) -> None:
        layout_blocks = self._blocks[layout_id]
        bits = layout_blocks.get(block_hash, 0) & ~bit
        if bits:
            layout_blocks[block_hash] = bits
        else:
            layout_blocks.pop(block_hash, None)

    def _drop_entries(self, holder: Holder) -> None:
        slot_bits = 3 << (2 * holder.slot)
        for block_hash in holder.blocks:
            self._clear_bit(holder.layout_id, block_hash, slot_bits)
        self.num_entries -= len(holder.blocks)
        holder.blocks = {}

    def _evict(self) -> None:
        largest = max(self._holders.values(), key=lambda h: len(h.blocks))
        oldest = next(iter(largest.blocks))
        del largest.blocks[oldest]
        self.num_entries -= 1
        self.num_evicted += 1
        self._clear_bit(largest.layout_id, oldest, 3 << (2 * largest.slot))
