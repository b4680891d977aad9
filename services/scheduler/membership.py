"""Worker membership from WorkerLoad heartbeats: a worker is a member while its heartbeats keep arriving.

Pure bookkeeping over a monotonic clock that is injected, so expiry is unit-tested without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.protocol import WorkerLoad, WorkerRole

#: Roles that can compute a prompt / generate tokens (`both` serves either side).
PREFILL_ROLES = frozenset({WorkerRole.PREFILL, WorkerRole.BOTH})
DECODE_ROLES = frozenset({WorkerRole.DECODE, WorkerRole.BOTH})


@dataclass(frozen=True)
class Member:
    """What the scheduler knows of one worker: its latest heartbeat and when it arrived."""

    worker_id: str
    role: WorkerRole
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    data_plane_address: str
    internal_address: str
    model_fingerprint: bytes
    layout_id: str
    draining: bool
    #: Our monotonic clock when the latest heartbeat arrived (never the worker's clock).
    last_seen_s: float

    @classmethod
    def from_load(cls, load: WorkerLoad, now_s: float) -> Member:
        """A member from one heartbeat received at `now_s`."""
        return cls(
            worker_id=load.worker_id,
            role=load.role,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks,
            data_plane_address=load.data_plane_address,
            internal_address=load.internal_address,
            model_fingerprint=load.model_fingerprint,
            layout_id=load.layout_id,
            draining=load.draining,
            last_seen_s=now_s,
        )

    @property
    def can_prefill(self) -> bool:
        """Whether this worker computes prompts (role prefill or both)."""
        return self.role in PREFILL_ROLES

    @property
    def can_decode(self) -> bool:
        """Whether this worker generates tokens (role decode or both)."""
        return self.role in DECODE_ROLES


class Membership:
    """The worker table, keyed by worker_id; entries older than `lease_s` are not members."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        self._members: dict[str, Member] = {}

    def observe(self, load: WorkerLoad) -> tuple[Member, bool]:
        """Record a heartbeat; returns the member and whether it just joined (new or back after expiry)."""
        now_s = self._clock()
        previous = self._members.get(load.worker_id)
        joined = previous is None or self._expired(previous, now_s)
        member = Member.from_load(load, now_s)
        self._members[load.worker_id] = member
        return member, joined

    def sweep(self) -> list[Member]:
        """Drop every member whose lease ran out; returns the dropped ones."""
        now_s = self._clock()
        expired = [m for m in self._members.values() if self._expired(m, now_s)]
        for member in expired:
            del self._members[member.worker_id]
        return expired

    def members(self) -> list[Member]:
        """Live members (expired ones excluded even before the next sweep), in worker_id order."""
        now_s = self._clock()
        return [m for _, m in sorted(self._members.items()) if not self._expired(m, now_s)]

    def get(self, worker_id: str) -> Member | None:
        """The live member with this id, if any."""
        member = self._members.get(worker_id)
        return None if member is None or self._expired(member, self._clock()) else member

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
