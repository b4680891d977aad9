"""Worker membership from WorkerLoad heartbeats, one table for the gateway and the scheduler.

One lease rule: a worker is a member while its latest heartbeat is younger than `lease_s` on our monotonic
clock (at exactly `lease_s` it is gone). A worker that went silent is remembered as *lost* for
`FORGET_AFTER_LEASES` leases, so `is_alive` can say "dead" (fail a waiting request at once) rather than
"never seen"; after that it is forgotten and the table stays bounded as workers come and go.
Pure bookkeeping over an injected clock: unit-tested without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.kv_costs import KvCosts
from deepinfer.protocol import WorkerLoad, WorkerRole

#: Roles that compute prompts / generate tokens (`both` serves either side).
PREFILL_ROLES = frozenset({WorkerRole.PREFILL, WorkerRole.BOTH})
DECODE_ROLES = frozenset({WorkerRole.DECODE, WorkerRole.BOTH})

#: A lost worker is remembered (is_alive False) for this many leases, then forgotten (is_alive None).
FORGET_AFTER_LEASES = 10


@dataclass(frozen=True)
class Member:
    """What is known of one worker: its latest heartbeat's fields and when it arrived."""

    worker_id: str
    role: WorkerRole
    model_fingerprint: bytes
    layout_id: str
    block_size: int
    max_num_seqs: int
    max_model_len: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    data_plane_address: str
    internal_address: str
    draining: bool
    #: Our monotonic clock when the latest heartbeat arrived (never the worker's clock).
    last_seen_s: float
    #: The worker's boot id (protocol 2.2; "" from older workers).
    epoch: str = ""
    #: Requests the worker admitted since it started (protocol 2.2; None from older workers).
    num_received: int | None = None
    #: Its measured costs (protocol 2.8; None from older workers): see WorkerLoad.
    kv_bytes_per_block: int | None = None
    prefill_tokens_per_s: float | None = None
    host_load_bytes_per_s: float | None = None
    store_load_bytes_per_s: float | None = None

    @classmethod
    def from_load(cls, load: WorkerLoad, now_s: float) -> Member:
        """A member from one heartbeat received at `now_s`."""
        fields = {name: getattr(load, name) for name in cls.__dataclass_fields__ if name != "last_seen_s"}
        return cls(**fields, last_seen_s=now_s)

    @property
    def kv_costs(self) -> KvCosts | None:
        """Its load-or-recompute rule at the rates it measured; None from a worker older than protocol 2.8."""
        if self.kv_bytes_per_block is None or self.prefill_tokens_per_s is None:
            return None
        return KvCosts(self.block_size, self.kv_bytes_per_block, self.prefill_tokens_per_s,
                       self.host_load_bytes_per_s, self.store_load_bytes_per_s)

    @property
    def can_prefill(self) -> bool:
        """Whether this worker computes prompts (role prefill or both)."""
        return self.role in PREFILL_ROLES

    @property
    def can_decode(self) -> bool:
        """Whether this worker generates tokens (role decode or both)."""
        return self.role in DECODE_ROLES


class Membership:
    """The worker table, keyed by worker_id; see the module docstring for the lease rule."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        self._members: dict[str, Member] = {}
        #: worker_id -> when it was swept out (our clock): lost, not yet forgotten.
        self._lost: dict[str, float] = {}

    def observe(self, load: WorkerLoad) -> tuple[Member, bool]:
        """Record a heartbeat; returns the member and whether it just joined (new, or back after its lease)."""
        now_s = self._clock()
        previous = self._members.get(load.worker_id)
        joined = previous is None or self._expired(previous, now_s)
        member = Member.from_load(load, now_s)
        self._members[load.worker_id] = member
        self._lost.pop(load.worker_id, None)
        self._forget(now_s)
        return member, joined

    def sweep(self) -> list[Member]:
        """Move every member whose lease ran out to the lost set; returns them (each once)."""
        now_s = self._clock()
        expired = [m for m in self._members.values() if self._expired(m, now_s)]
        for member in expired:
            del self._members[member.worker_id]
            self._lost[member.worker_id] = now_s
        self._forget(now_s)
        return expired

    def members(self) -> list[Member]:
        """Live members (expired ones excluded even before the next sweep), in worker_id order."""
        now_s = self._clock()
        return [m for _, m in sorted(self._members.items()) if not self._expired(m, now_s)]

    def get(self, worker_id: str) -> Member | None:
        """The live member with this id, if any."""
        member = self._members.get(worker_id)
        return None if member is None or self._expired(member, self._clock()) else member

    def is_alive(self, worker_id: str) -> bool | None:
        """True while its lease holds, False once it lapsed (until forgotten), None for a worker never seen."""
        if self.get(worker_id) is not None:
            return True
        return False if worker_id in self._members or worker_id in self._lost else None

    def latest(self) -> Member | None:
        """The live member whose heartbeat arrived last (None before any): the model's current identity."""
        return max(self.members(), key=lambda m: m.last_seen_s, default=None)

    def has_decode(self) -> bool:
        """A live, non-draining worker can decode (role decode or both)."""
        return any(m.can_decode and not m.draining for m in self.members())

    def count_by_role(self) -> dict[WorkerRole, int]:
        """Live members per role (every role present, zero included)."""
        counts = dict.fromkeys(WorkerRole, 0)
        for member in self.members():
            counts[member.role] += 1
        return counts

    def __len__(self) -> int:
        return len(self.members())

    def _expired(self, member: Member, now_s: float) -> bool:
        return now_s - member.last_seen_s >= self.lease_s

    def _forget(self, now_s: float) -> None:
        horizon_s = now_s - FORGET_AFTER_LEASES * self.lease_s
        for worker_id in [w for w, lost_s in self._lost.items() if lost_s < horizon_s]:
            del self._lost[worker_id]
        for worker_id in [w for w, m in self._members.items() if m.last_seen_s < horizon_s]:
            del self._members[worker_id]  # never swept (the gateway does not sweep): forget it the same way
