"""LeastLoadedPolicy and in-flight counting, with exact worker ids; the handler's route loop on a FakeBus."""

from __future__ import annotations

import random
import subprocess
import sys

from deepinfer import subjects
from deepinfer.config import CommonSettings, SchedulerSettings
from deepinfer.membership import Member
from deepinfer.protocol import RouteDecision, RouteRequest, RouteStatus, WorkerLoad, WorkerRole
from deepinfer.telemetry import new_registry
from deepinfer.testing import FakeBroker, FakeBus
from services.scheduler.handler import build_handler
from services.scheduler.inflight import InFlight
from services.scheduler.policy import LeastLoadedPolicy

FP = b"fingerprint-a"


def member(worker_id: str, role: WorkerRole, running: int = 0, waiting: int = 0, **fields) -> Member:
    values = {
        "num_free_blocks": 100,
        "num_total_blocks": 100,
        "data_plane_address": "127.0.0.1:1",
        "internal_address": "127.0.0.1:2",
        "model_fingerprint": FP,
        "layout_id": "L",
        "block_size": 16,
        "max_num_seqs": 256,
        "max_model_len": 4096,
        "draining": False,
        "last_seen_s": 0.0,
    }
    return Member(
        worker_id=worker_id, role=role, num_running=running, num_waiting=waiting, **{**values, **fields}
    )


def request(request_id: str = "r1", fingerprint: bytes | None = FP, exclude: list[str] | None = None) -> RouteRequest:
    return RouteRequest(
        request_id=request_id, gateway_id="g1", num_prompt_tokens=40, model_fingerprint=fingerprint,
        exclude_worker_ids=exclude or [],
    )


def pick(
    members: list[Member], in_flight: dict[str, int] | None = None, seed: int = 0, **req
) -> RouteDecision:
    policy = LeastLoadedPolicy("sched-1", rng=random.Random(seed))
    return policy.pick(request(**req), members, in_flight or {})


P, D, B = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH


def test_least_loaded_prefill_and_decode_counting_waiting_requests():
    members = [
        member("p1", P, running=1, waiting=3),
        member("p2", P, running=2, waiting=0),
        member("d1", D, running=1),
        member("d2", D, running=0, waiting=3),
    ]
    decision = pick(members)
    assert decision == RouteDecision(
        request_id="r1",
        status=RouteStatus.ACCEPTED,
        prefill_worker_id="p2",
        decode_worker_id="d1",
        expected_cached_tokens=0,
        scheduler_id="sched-1",
    )


def test_excluded_workers_are_avoided_while_another_decode_worker_can_take_it():
    members = [member("p1", P), member("p2", P, running=5), member("d1", D), member("d2", D, running=5)]
    decision = pick(members, exclude=["d1", "p1"])  # a migrated request's lost workers: the busier ones win
    assert (decision.prefill_worker_id, decision.decode_worker_id) == ("p2", "d2")
    only = pick([member("p1", P), member("d1", D)], exclude=["d1"])  # the one decode worker: taken anyway
    assert only.status is RouteStatus.ACCEPTED and only.decode_worker_id == "d1"


def test_equal_load_goes_to_fewer_running():
    members = [member("p1", P), member("d1", D, running=2), member("d2", D, running=1, waiting=1)]
    assert pick(members).decode_worker_id == "d2"


def test_full_ties_are_broken_at_random_by_the_seeded_rng():
    members = [member("p1", P), member("d1", D), member("d2", D), member("d3", D)]
    chosen = [pick(members, seed=seed).decode_worker_id for seed in range(40)]
    assert set(chosen) == {"d1", "d2", "d3"}
    assert chosen == [pick(list(reversed(members)), seed=seed).decode_worker_id for seed in range(40)]


def test_in_flight_decisions_count_as_load():
    members = [member("p1", P), member("p2", P, running=1), member("d1", D), member("d2", D, running=1)]
    decision = pick(members, in_flight={"p1": 2, "d1": 2})
    assert (decision.prefill_worker_id, decision.decode_worker_id) == ("p2", "d2")


def test_draining_workers_are_never_picked():
    members = [member("p1", P, draining=True), member("p2", P, running=9), member("d1", D, draining=True)]
    members.append(member("d2", D, running=9))
    decision = pick(members)
    assert (decision.prefill_worker_id, decision.decode_worker_id) == ("p2", "d2")
    only_draining = pick([member("p1", P), member("d1", D, draining=True)])
    assert only_draining.status is RouteStatus.OVERLOADED


def test_workers_of_another_model_fingerprint_are_not_picked():
    members = [
        member("p1", P, model_fingerprint=b"other"),
        member("p2", P, running=5),
        member("d1", D, model_fingerprint=b"other"),
        member("d2", D, running=5),
    ]
    decision = pick(members)
    assert (decision.prefill_worker_id, decision.decode_worker_id) == ("p2", "d2")
    assert pick(members, fingerprint=b"nobody").status is RouteStatus.OVERLOADED
    anything = pick(members, fingerprint=None)  # a request without a fingerprint matches every worker
    assert (anything.prefill_worker_id, anything.decode_worker_id) == ("p1", "d1")


def test_no_decode_worker_is_overloaded_with_retry_after():
    for members in ([], [member("p1", P)]):
        decision = pick(members)
        assert decision.status is RouteStatus.OVERLOADED
        assert decision.decode_worker_id is None and decision.prefill_worker_id is None
        assert decision.retry_after_s is not None and decision.retry_after_s > 0


def test_saturated_decode_workers_are_skipped_and_all_saturated_is_overloaded():
    full = {"num_free_blocks": 0, "num_total_blocks": 64}
    members = [member("p1", P), member("d1", D, **full), member("d2", D, running=7)]
    assert pick(members).decode_worker_id == "d2"
    assert pick([member("p1", P), member("d1", D, **full)]).status is RouteStatus.OVERLOADED
    # A worker that has not reported its pool yet (0 total blocks) is not saturated.
    unknown = pick([member("d1", D, num_free_blocks=0, num_total_blocks=0)])
    assert unknown.decode_worker_id == "d1"


def test_no_prefill_worker_means_decode_computes_the_prompt():
    decision = pick([member("d1", D)])
    assert decision.status is RouteStatus.ACCEPTED
    assert (decision.prefill_worker_id, decision.decode_worker_id) == (None, "d1")


def test_prefill_worker_with_another_kv_layout_is_not_paired():
    decision = pick([member("p1", P, layout_id="other"), member("d1", D)])
    assert (decision.prefill_worker_id, decision.decode_worker_id) == (None, "d1")


def test_a_both_worker_serves_either_side_and_never_hands_off_to_itself():
    alone = pick([member("b1", B)])
    assert (alone.prefill_worker_id, alone.decode_worker_id) == (None, "b1")
    with_prefill = pick([member("b1", B, running=3), member("p1", P)])
    assert (with_prefill.prefill_worker_id, with_prefill.decode_worker_id) == ("p1", "b1")
    as_prefill = pick([member("b1", B, running=2), member("p1", P, running=5), member("d1", D)])
    assert (as_prefill.prefill_worker_id, as_prefill.decode_worker_id) == ("b1", "d1")


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def accepted(request_id: str, prefill: str | None, decode: str, scheduler_id: str = "s") -> RouteDecision:
    return RouteDecision(
        request_id=request_id,
        status=RouteStatus.ACCEPTED,
        prefill_worker_id=prefill,
        decode_worker_id=decode,
        scheduler_id=scheduler_id,
    )


def test_in_flight_counts_end_by_ttl_or_by_a_later_heartbeat():
    clock = Clock()
    in_flight = InFlight(ttl_s=5.0, settle_s=0.05, clock=clock)
    in_flight.add(accepted("r1", "p1", "d1"))
    in_flight.add(accepted("r1", "p1", "d1"))  # the same request counts once
    in_flight.add(accepted("r2", None, "d1"))
    in_flight.add(RouteDecision(request_id="r3", status=RouteStatus.OVERLOADED, scheduler_id="s"))
    assert in_flight.counts() == {"p1": 1, "d1": 2}
    in_flight.on_heartbeat("d1")  # arrived with the decisions: may not include them yet
    assert in_flight.counts() == {"p1": 1, "d1": 2}
    clock.now_s = 0.1
    in_flight.add(accepted("r4", "p1", "d2"))
    in_flight.on_heartbeat("d1")
    in_flight.on_heartbeat("p1")  # r1 is old enough to show in p1's heartbeat; r4 is not
    assert in_flight.counts() == {"p1": 1, "d2": 1}
    clock.now_s = 5.05
    assert in_flight.expire() == 0
    clock.now_s = 5.2
    assert in_flight.expire() == 2
    assert in_flight.counts() == {} and in_flight.total() == 0


def heartbeat(worker_id: str, role: WorkerRole, **fields) -> WorkerLoad:
    values = {
        "model": "m",
        "model_fingerprint": FP,
        "layout_id": "L",
        "block_size": 16,
        "max_num_seqs": 256,
        "max_model_len": 4096,
        "data_plane_address": "127.0.0.1:1",
        "internal_address": "127.0.0.1:2",
        "ts": 0.0,
    }
    return WorkerLoad(worker_id=worker_id, role=role, **{**values, **fields})


async def test_handler_route_loop_spreads_load_and_counts_peer_decisions():
    broker = FakeBroker()
    settings = SchedulerSettings(common=CommonSettings(served_model_name="m"), scheduler_id="sched-a")
    handler = build_handler(settings, FakeBus(broker, "sched"), new_registry(False), rng=random.Random(1))
    await handler.start()
    client = FakeBus(broker, "client")
    decisions: list[RouteDecision] = []

    async def on_decision(decision: RouteDecision, _msg) -> None:
        decisions.append(decision)

    await client.subscribe(subjects.decisions("m"), on_decision, message_type=RouteDecision)
    for worker_id, role in [("p1", P), ("p2", P), ("d1", D), ("d2", D)]:
        await client.publish(subjects.heartbeat("m", worker_id), heartbeat(worker_id, role))
    await broker.settle()
    # No heartbeat between the requests: only the in-flight counts keep them from piling onto one worker.
    replies = [
        await client.request(subjects.route("m"), request(f"r{i}"), RouteDecision, timeout_s=1.0)
        for i in range(4)
    ]
    assert sorted(r.decode_worker_id for r in replies) == ["d1", "d1", "d2", "d2"]
    assert sorted(r.prefill_worker_id for r in replies) == ["p1", "p1", "p2", "p2"]
    await broker.settle()
    assert decisions == replies  # each decision published once, as replied
    assert handler.in_flight.counts() == {"p1": 2, "p2": 2, "d1": 2, "d2": 2}  # own echoes not counted twice
    await client.publish(subjects.decisions("m"), accepted("peer-1", "p1", "d1", scheduler_id="sched-b"))
    await broker.settle()
    assert handler.in_flight.counts()["d1"] == 3
    assert handler.route(request("r9")).decode_worker_id == "d2"
    await handler.drain(1.0)
    assert not handler.is_ready() and handler.not_ready_reason() == "draining"
    await handler.close()


def test_scheduler_modules_import_without_torch():
    code = (
        "import sys\nsys.modules['torch'] = None\n"
        "import services.scheduler.main, deepinfer.service\n"
        "assert sys.modules.get('torch') is None\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_in_flight_counts_end_as_the_workers_admitted_count_grows():
    clock = Clock()
    in_flight = InFlight(ttl_s=5.0, settle_s=0.05, clock=clock)
    in_flight.on_heartbeat("p1", num_received=7)
    for i in range(3):
        in_flight.add(accepted(f"r{i}", "p1", "d1"))
    in_flight.on_heartbeat("p1", num_received=7)  # none arrived yet, however old the counts are
    clock.now_s = 1.0
    in_flight.on_heartbeat("p1", num_received=7)
    assert in_flight.counts() == {"p1": 3, "d1": 3}
    in_flight.on_heartbeat("p1", num_received=9)  # two arrived: the two oldest end
    assert in_flight.counts() == {"p1": 1, "d1": 3}
    in_flight.on_heartbeat("d1", num_received=0)  # first heartbeat with the count: the settle rule, this once
    assert in_flight.counts() == {"p1": 1}
    in_flight.add(accepted("r9", "p1", "d1"))
    in_flight.on_heartbeat("p1", num_received=1)  # smaller: p1 restarted, its requests are gone
    assert in_flight.counts() == {"d1": 1}
