"""The one membership table (gateway and scheduler): join, refresh, the lease edge, lost then forgotten, rejoin
(fake clock, no sleeping)."""

from __future__ import annotations

import pytest

from deepinfer.config import CommonSettings, GatewaySettings, SchedulerSettings
from deepinfer.membership import FORGET_AFTER_LEASES, Member, Membership
from deepinfer.protocol import WorkerLoad, WorkerRole


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now_s: float = 100.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def load(worker_id: str, role: WorkerRole = WorkerRole.DECODE, **fields) -> WorkerLoad:
    defaults = {
        "model": "m",
        "model_fingerprint": b"fp-1",
        "layout_id": "layout-a",
        "block_size": 16,
        "max_num_seqs": 64,
        "max_model_len": 4096,
        "data_plane_address": f"10.0.0.1:{8100 + len(worker_id)}",
        "internal_address": "10.0.0.1:8004",
        "ts": 1.0,
    }
    return WorkerLoad(worker_id=worker_id, role=role, **{**defaults, **fields})


def test_heartbeat_makes_a_member_with_its_numbers():
    clock = FakeClock()
    membership = Membership(3.0, clock=clock)
    member, joined = membership.observe(
        load("d1", num_running=2, num_waiting=1, num_free_blocks=7, num_total_blocks=9, draining=True)
    )
    assert joined
    assert member == Member(
        worker_id="d1",
        role=WorkerRole.DECODE,
        num_running=2,
        num_waiting=1,
        num_free_blocks=7,
        num_total_blocks=9,
        data_plane_address="10.0.0.1:8102",
        internal_address="10.0.0.1:8004",
        model_fingerprint=b"fp-1",
        layout_id="layout-a",
        block_size=16,
        max_num_seqs=64,
        max_model_len=4096,
        draining=True,
        last_seen_s=100.0,
    )
    assert membership.members() == [member]
    assert membership.get("d1") == member
    _, joined_again = membership.observe(load("d1", num_running=5))
    assert not joined_again
    assert membership.get("d1").num_running == 5


def test_default_lease_drops_a_silent_worker_after_three_seconds():
    settings = SchedulerSettings(common=CommonSettings())
    clock = FakeClock()
    membership = Membership(settings.worker_lease_s, clock=clock)
    membership.observe(load("p1", WorkerRole.PREFILL))
    membership.observe(load("d1"))
    clock.advance(2.0)
    membership.observe(load("d1"))  # d1 keeps beating, p1 went silent at t=0
    clock.advance(0.99)
    assert [m.worker_id for m in membership.members()] == ["d1", "p1"]
    assert membership.sweep() == []
    clock.advance(0.01)  # p1 silent for exactly 3.0 s
    assert [m.worker_id for m in membership.members()] == ["d1"]  # hidden even before the sweep
    assert membership.get("p1") is None
    assert [m.worker_id for m in membership.sweep()] == ["p1"]
    assert membership.sweep() == []
    clock.advance(2.0)  # d1 silent for 3.0 s too
    assert [m.worker_id for m in membership.sweep()] == ["d1"]
    assert len(membership) == 0


def test_a_worker_that_beats_again_after_expiry_rejoins():
    clock = FakeClock()
    membership = Membership(1.0, clock=clock)
    membership.observe(load("d1"))
    clock.advance(1.5)
    _, joined = membership.observe(load("d1"))  # expired but not swept yet: still a (re)join
    assert joined
    assert membership.sweep() == []
    assert [m.worker_id for m in membership.members()] == ["d1"]


def test_roles_and_counts():
    clock = FakeClock()
    membership = Membership(3.0, clock=clock)
    for worker_id, role in [("p1", WorkerRole.PREFILL), ("d1", WorkerRole.DECODE), ("b1", WorkerRole.BOTH)]:
        membership.observe(load(worker_id, role))
    by_id = {m.worker_id: m for m in membership.members()}
    assert [(w, m.can_prefill, m.can_decode) for w, m in sorted(by_id.items())] == [
        ("b1", True, True),
        ("d1", False, True),
        ("p1", True, False),
    ]
    assert membership.count_by_role() == {
        WorkerRole.PREFILL: 1,
        WorkerRole.DECODE: 1,
        WorkerRole.BOTH: 1,
    }
    assert membership.has_decode()


def test_lease_must_be_positive():
    with pytest.raises(ValueError, match="lease_s"):
        Membership(0.0)


@pytest.mark.parametrize("settings_cls", [GatewaySettings, SchedulerSettings])
def test_lease_edge_is_the_same_for_gateway_and_scheduler(settings_cls):
    lease_s = settings_cls(common=CommonSettings()).worker_lease_s
    clock = FakeClock()
    membership = Membership(lease_s, clock=clock)
    membership.observe(load("d1"))
    clock.advance(lease_s - 1e-6)
    assert membership.is_alive("d1") is True and membership.get("d1") is not None
    clock.advance(1e-6)  # exactly lease_s since the last heartbeat: gone
    assert membership.is_alive("d1") is False and membership.get("d1") is None
    assert membership.members() == [] and not membership.has_decode()


def test_a_lost_worker_is_dead_until_forgotten_then_unknown():
    clock = FakeClock()
    membership = Membership(1.0, clock=clock)
    assert membership.is_alive("d1") is None  # never seen
    membership.observe(load("d1"))
    clock.advance(1.0)
    assert [m.worker_id for m in membership.sweep()] == ["d1"]
    assert membership.is_alive("d1") is False  # a request waiting on it fails at once
    clock.advance(FORGET_AFTER_LEASES * 1.0 + 0.1)
    membership.sweep()
    assert membership.is_alive("d1") is None  # forgotten: the table stays bounded


def test_an_unswept_table_forgets_silent_workers_on_later_heartbeats():
    clock = FakeClock()
    membership = Membership(1.0, clock=clock)  # the gateway never sweeps
    membership.observe(load("old"))
    clock.advance(FORGET_AFTER_LEASES * 1.0 + 0.1)
    membership.observe(load("new"))
    assert membership.is_alive("old") is None and membership.is_alive("new") is True


def test_latest_member_gives_the_model_identity():
    clock = FakeClock()
    membership = Membership(3.0, clock=clock)
    assert membership.latest() is None
    membership.observe(load("p1", WorkerRole.PREFILL, model_fingerprint=b"fp-old", block_size=32))
    clock.advance(0.5)
    membership.observe(load("d1", model_fingerprint=b"fp-new"))
    latest = membership.latest()
    assert latest is not None and (latest.worker_id, latest.model_fingerprint, latest.block_size) == (
        "d1", b"fp-new", 16)


def test_measured_costs_cross_the_heartbeat_and_an_older_worker_has_none():
    from deepinfer.kv_costs import KvCosts

    beat = load("w1", kv_bytes_per_block=2 << 20, prefill_tokens_per_s=16_000.0, host_load_bytes_per_s=4e10,
                store_load_bytes_per_s=None)
    member = Member.from_load(WorkerLoad.from_bytes(beat.to_bytes()), 0.0)
    assert member.kv_costs == KvCosts(16, 2 << 20, 16_000.0, 4e10, None)
    older = load("w2").model_dump()  # a 2.7 worker's heartbeat: none of the fields
    for name in ("kv_bytes_per_block", "prefill_tokens_per_s", "host_load_bytes_per_s", "store_load_bytes_per_s"):
        del older[name]
    older["v"] = "2.7"
    assert Member.from_load(WorkerLoad.model_validate(older), 0.0).kv_costs is None
