"""The live store shards, as their heartbeats say: a shard is live from its first KvStoreHeartbeat until
`lease_s` passes without one, or while it announces draining."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.protocol import KvStoreHeartbeat


@dataclass(frozen=True)
class Shard:
    """One store shard: its name, where its data plane listens, whether its RAM tier is shared memory on
    host `host_id`, and whether it serves that memory to transfer engines (readers on other hosts)."""

    name: str
    data_plane_address: str
    last_seen_s: float
    host_id: str = ""
    shm: bool = False
    transfer_engine: bool = False


class ShardSet:
    """Shard name → Shard, fed by heartbeats; `live()` is what rendezvous hashing runs over."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        self._shards: dict[str, Shard] = {}

    def observe(self, beat: KvStoreHeartbeat) -> None:
        """Take one heartbeat: a draining shard leaves the set at once (its blocks become misses)."""
        if beat.draining:
            self._shards.pop(beat.shard, None)
            return
        self._shards[beat.shard] = Shard(beat.shard, beat.data_plane_address, self._clock(), beat.host_id, beat.shm,
                                         beat.transfer_engine)

    def forget(self, name: str) -> None:
        """Drop a shard now (its data plane refused us); its next heartbeat brings it back."""
        self._shards.pop(name, None)

    def live(self) -> dict[str, Shard]:
        """The shards heard from within lease_s, by name."""
        now = self._clock()
        expired = [name for name, shard in self._shards.items() if now - shard.last_seen_s > self.lease_s]
        for name in expired:
            del self._shards[name]
        return dict(self._shards)
