"""The scheduler on a real nats-server: least-loaded routing, worker expiry, two replicas, the real process."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry

from deepinfer import subjects
from deepinfer.bus import Bus
from deepinfer.config import CommonSettings, SchedulerSettings
from deepinfer.nats_server import NatsServer
from deepinfer.protocol import RouteDecision, RouteRequest, RouteStatus, WorkerLoad, WorkerRole
from deepinfer.telemetry import new_registry
from services.scheduler.handler import SchedulerHandler, build_handler

pytestmark = pytest.mark.integration

FP = b"fp-integration"


def unique_model() -> str:
    """A served model name no other test uses (the session's server is shared)."""
    return f"m-{uuid.uuid4().hex[:8]}"


def heartbeat(model: str, worker_id: str, role: WorkerRole, **fields) -> WorkerLoad:
    return WorkerLoad(
        worker_id=worker_id,
        role=role,
        model=model,
        model_fingerprint=FP,
        layout_id="L",
        block_size=16,
        max_num_seqs=256,
        max_model_len=4096,
        data_plane_address="127.0.0.1:9",
        internal_address="127.0.0.1:10",
        ts=time.time(),
        **fields,
    )


def route_request(request_id: str) -> RouteRequest:
    return RouteRequest(request_id=request_id, gateway_id="g1", num_prompt_tokens=32, model_fingerprint=FP)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Poll until `predicate()` holds; returns the seconds it took (fails the test after `timeout_s`)."""
    started_s = time.monotonic()
    while not predicate():
        if time.monotonic() - started_s > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - started_s


async def start_scheduler(
    server: NatsServer, model: str, scheduler_id: str, lease_s: float = 3.0, registry=None
) -> tuple[SchedulerHandler, Bus]:
    bus = await Bus.connect(server.url, name=scheduler_id, token=server.token)
    common = CommonSettings(nats_url=server.url, served_model_name=model)
    settings = SchedulerSettings(common=common, scheduler_id=scheduler_id, worker_lease_s=lease_s)
    handler = build_handler(settings, bus, registry or new_registry(False), rng=random.Random(0))
    await handler.start()
    return handler, bus


@pytest.fixture
async def scheduler(
    nats_server: NatsServer,
) -> AsyncIterator[tuple[str, SchedulerHandler, CollectorRegistry]]:
    model = unique_model()
    registry = new_registry(False)
    handler, bus = await start_scheduler(nats_server, model, "sched-a", lease_s=1.0, registry=registry)
    yield model, handler, registry
    await handler.drain(1.0)
    await bus.drain()
    await handler.close()


async def test_route_request_gets_the_least_loaded_pair(scheduler, bus: Bus):
    model, handler, _ = scheduler
    loads = {
        ("p1", WorkerRole.PREFILL): {"num_running": 3},
        ("p2", WorkerRole.PREFILL): {"num_running": 1, "num_waiting": 1},
        ("d1", WorkerRole.DECODE): {"num_running": 1},
        ("d2", WorkerRole.DECODE): {"num_running": 4},
    }
    for (worker_id, role), numbers in loads.items():
        await bus.publish(subjects.heartbeat(model, worker_id), heartbeat(model, worker_id, role, **numbers))
    await wait_until(lambda: len(handler.membership) == 4)
    decision = await bus.request(subjects.route(model), route_request("r1"), RouteDecision, timeout_s=2.0)
    assert decision.status is RouteStatus.ACCEPTED
    assert (decision.prefill_worker_id, decision.decode_worker_id) == ("p2", "d1")
    assert decision.scheduler_id == "sched-a"


async def test_a_worker_that_stops_beating_is_dropped_then_requests_are_overloaded(scheduler, bus: Bus):
    model, handler, registry = scheduler  # worker lease 1 s
    await bus.publish(subjects.heartbeat(model, "d1"), heartbeat(model, "d1", WorkerRole.DECODE))
    await wait_until(lambda: handler.membership.get("d1") is not None)
    first = await bus.request(subjects.route(model), route_request("r1"), RouteDecision, timeout_s=2.0)
    assert (first.status, first.prefill_worker_id, first.decode_worker_id) == (
        RouteStatus.ACCEPTED,
        None,
        "d1",
    )
    # d1 sends no more heartbeats: gone within the lease plus one sweep interval.
    took_s = await wait_until(
        lambda: registry.get_sample_value("deepinfer_scheduler_workers_expired_total") == 1.0
    )
    assert took_s <= handler.membership.lease_s + handler.sweep_interval_s + 0.5
    later = await bus.request(subjects.route(model), route_request("r2"), RouteDecision, timeout_s=2.0)
    assert later.status is RouteStatus.OVERLOADED and later.retry_after_s and later.decode_worker_id is None


async def test_two_replicas_share_the_queue_group_and_each_others_decisions(
    nats_server: NatsServer, bus: Bus
):
    model = unique_model()
    replicas = [await start_scheduler(nats_server, model, f"sched-{name}") for name in "ab"]
    try:
        published: list[RouteDecision] = []

        async def on_decision(decision: RouteDecision, _msg) -> None:
            published.append(decision)

        await bus.subscribe(subjects.decisions(model), on_decision, message_type=RouteDecision)
        for worker_id in ("d1", "d2"):
            await bus.publish(
                subjects.heartbeat(model, worker_id), heartbeat(model, worker_id, WorkerRole.DECODE)
            )
        await wait_until(lambda: all(len(handler.membership) == 2 for handler, _ in replicas))
        num_requests = 24
        replies = await asyncio.gather(
            *(
                bus.request(subjects.route(model), route_request(f"r{i}"), RouteDecision, timeout_s=5.0)
                for i in range(num_requests)
            )
        )
        assert sorted(r.request_id for r in replies) == sorted(f"r{i}" for i in range(num_requests))
        assert {r.scheduler_id for r in replies} == {"sched-a", "sched-b"}  # both replicas answered
        await wait_until(lambda: len(published) >= num_requests)
        await asyncio.sleep(0.1)  # a duplicate answer would show up here
        assert sorted(d.request_id for d in published) == sorted(
            r.request_id for r in replies
        )  # exactly once
        # Every replica counts every decision, its own and its peer's, as in-flight load.
        for handler, _ in replicas:
            await wait_until(lambda handler=handler: handler.in_flight.total() == num_requests)
        num_on_d1 = sum(r.decode_worker_id == "d1" for r in replies)
        assert abs(num_on_d1 - (num_requests - num_on_d1)) <= 2  # spread, not piled onto one worker
    finally:
        for handler, replica_bus in replicas:
            await replica_bus.drain()
            await handler.close()


async def route_until_accepted(bus: Bus, model: str, timeout_s: float = 5.0) -> RouteDecision:
    """Ask until the scheduler has seen the heartbeats (it answers overloaded before)."""
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        decision = await bus.request(subjects.route(model), route_request(f"r{attempt}"), RouteDecision, 5.0)
        if decision.status is RouteStatus.ACCEPTED or time.monotonic() > deadline:
            return decision
        attempt += 1
        await asyncio.sleep(0.05)


async def read_started_line(stream: asyncio.StreamReader, timeout_s: float = 20.0) -> dict:
    """The JSON "started" log line of a service process (earlier lines are skipped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        line = await asyncio.wait_for(stream.readline(), max(0.1, deadline - time.monotonic()))
        if not line:
            raise AssertionError("the process ended before logging that it started")
        entry = json.loads(line)
        if entry.get("msg", "").startswith("scheduler started"):
            return entry


@pytest.mark.parametrize(
    "command",
    [("-m", "services.scheduler"), ("-m", "deepinfer.cli", "serve", "scheduler")],
    ids=["python-m", "cli"],
)
async def test_the_scheduler_process_serves_and_exits_zero_on_sigterm(
    nats_server: NatsServer, bus: Bus, command: tuple[str, ...]
):
    model = unique_model()
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", "/tmp"),
        "DEEPINFER_NATS_URL": nats_server.url,
        "DEEPINFER_NATS_TOKEN": nats_server.token,
        "DEEPINFER_SERVED_MODEL_NAME": model,
        "DEEPINFER_SCHEDULER_INTERNAL_PORT": "0",
        "DEEPINFER_SCHEDULER_SCHEDULER_ID": "sched-proc",
        "DEEPINFER_LOG_FORMAT": "json",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, *command, env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        assert process.stderr is not None
        started = await read_started_line(process.stderr)
        port = started["ports"]["internal"]
        assert started["ids"] == {"scheduler_id": "sched-proc"} and started["nats_url"] == nats_server.url
        assert nats_server.token not in json.dumps(started)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as client:
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/ready")).status_code == 200
            await bus.publish(subjects.heartbeat(model, "d1"), heartbeat(model, "d1", WorkerRole.DECODE))
            await bus.publish(subjects.heartbeat(model, "p1"), heartbeat(model, "p1", WorkerRole.PREFILL))
            decision = await route_until_accepted(bus, model)
            assert (decision.prefill_worker_id, decision.decode_worker_id) == ("p1", "d1")
            assert decision.scheduler_id == "sched-proc"
            metrics = (await client.get("/metrics")).text
            assert 'deepinfer_scheduler_decisions_total{status="accepted"} 1.0' in metrics
            assert 'deepinfer_scheduler_members{role="decode"} 1.0' in metrics
            assert "deepinfer_trace_spans_dropped_total 0.0" in metrics  # every service counts dropped spans
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 15.0) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_the_kv_index_follows_events_resyncs_after_a_gap_and_forgets_a_lost_worker(scheduler, bus: Bus):
    from deepinfer.protocol import KvEvent, KvEventBatch, KvEventKind, SnapshotPage, SnapshotRequest

    model, handler, registry = scheduler  # worker lease 1 s
    held = [bytes([i]) * 16 for i in range(5)]
    cut = {"seq": 0, "hashes": held[:3]}
    asked: list[SnapshotRequest] = []

    async def on_snapshot(request: SnapshotRequest, msg) -> None:
        asked.append(request)
        page = cut["hashes"][request.cursor : request.cursor + 2]
        end = request.cursor + 2
        await bus.reply(msg, SnapshotPage(worker_id="p1", seq=cut["seq"], block_hashes=page, epoch="boot-1",
                                          next_cursor=end if end < len(cut["hashes"]) else None, cursor=request.cursor))

    sub = await bus.subscribe(subjects.snapshot(model, "p1"), on_snapshot, message_type=SnapshotRequest)
    await bus.publish(subjects.heartbeat(model, "p1"), heartbeat(model, "p1", WorkerRole.PREFILL, epoch="boot-1"))
    index = handler.kv_feed.index
    await wait_until(lambda: index.num_entries == 3)
    assert [(r.cursor, r.seq) for r in asked] == [(0, None), (2, 0)]

    def batch(seq: int, *hashes: bytes) -> KvEventBatch:
        event = KvEvent(event_kind=KvEventKind.STORED, block_hashes=list(hashes))
        return KvEventBatch(worker_id="p1", seq=seq, events=[event], ts=time.time(), epoch="boot-1")

    await bus.publish(subjects.kv_events(model, "p1"), batch(1, held[3]))
    await wait_until(lambda: index.num_entries == 4)
    cut.update(seq=3, hashes=held)  # batches 2 and 3 are lost on their way: the next one shows the gap
    await bus.publish(subjects.kv_events(model, "p1"), batch(4, held[4]))
    await wait_until(lambda: len(asked) == 5 and index.num_entries == 5)
    assert index.num_gaps == 1
    assert index.holders("L", held[4]) == {"p1": "device"}
    for _ in range(3):  # p1 keeps beating while the others stay silent
        await bus.publish(subjects.heartbeat(model, "p1"), heartbeat(model, "p1", WorkerRole.PREFILL, epoch="boot-1"))
        await asyncio.sleep(0.2)
    await sub.unsubscribe()
    await wait_until(lambda: index.num_entries == 0, timeout_s=3.0)  # lease 1 s: swept with its entries
    assert index.sync_state("p1") is None
