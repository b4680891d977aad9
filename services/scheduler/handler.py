"""The scheduler's handler. One loop, per RouteRequest on `route(model)` (queue group `scheduler`):

    receive RouteRequest → route (policy over live members with room + in-flight counts) → reply RouteDecision
    → publish the decision on `decisions(model)` (peers count it as in-flight load)

When live decode workers exist but none has room, the request waits in the admission queue (admission.py) and is
routed by the first heartbeat that shows room, or answered overloaded when its wait runs out.

Beside it: heartbeats on `heartbeat_all(model)` keep the membership table, peers' decisions feed the in-flight
counts, the KV index feed (kv_feed.py) follows every worker's and store shard's KV events, and a sweeper drops
workers whose lease ran out (with their index entries). Everything runs on the event loop and never blocks:
routing is a prefix walk over the index and a few comparisons over the members.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

from opentelemetry.trace import NoOpTracer, Tracer
from prometheus_client import CollectorRegistry

from deepinfer import subjects
from deepinfer.bus import IncomingMsg, MessageBus, Subscriptions
from deepinfer.config import SchedulerSettings
from deepinfer.membership import Membership
from deepinfer.protocol import RouteDecision, RouteRequest, RouteStatus, WorkerLoad, WorkerRole
from deepinfer.tasks import BackgroundTasks
from deepinfer.telemetry import counter, gauge, histogram, request_context
from services.scheduler.admission import AdmissionQueue, Waiting, with_room
from services.scheduler.inflight import InFlight
from services.scheduler.kv_feed import KvIndexFeed
from services.scheduler.kv_index import KvIndex
from services.scheduler.policy import (
    DEFAULT_RETRY_AFTER_S,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    overloaded,
    serves_model,
    worker_load,
)
from services.scheduler.prefix_policy import CostWeights, PrefixPolicy

log = logging.getLogger(__name__)

#: Longest pause between two membership sweeps (a dead worker is gone within lease + this).
MAX_SWEEP_INTERVAL_S = 0.5
#: Routing takes tens of microseconds; the reply and publish add a round trip to the server.
ROUTE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: A wait for room lasts up to admission_wait_s (1 s by default).
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class SchedulerHandler:
    """Answers route requests for one model; a `deepinfer.service.Handler`."""

    def __init__(
        self,
        *,
        model: str,
        scheduler_id: str,
        bus: MessageBus,
        membership: Membership,
        in_flight: InFlight,
        policy: RoutingPolicy,
        registry: CollectorRegistry,
        kv_feed: KvIndexFeed,
        tracer: Tracer | None = None,
        max_queued: int = 0,
        max_wait_s: float = 0.0,
        warm_up_s: float = 0.0,
    ) -> None:
        self.model = model
        self.scheduler_id = scheduler_id
        self.bus = bus
        self.membership = membership
        self.in_flight = in_flight
        self.policy = policy
        self.kv_feed = kv_feed
        self.warm_up_s = warm_up_s
        self.metrics = SchedulerMetrics(registry)
        self.admission = AdmissionQueue(max_queued, max_wait_s, self._on_wait_expired)
        self._tasks = BackgroundTasks(f"scheduler {scheduler_id}")
        self.tracer = tracer or NoOpTracer()
        self.sweep_interval_s = min(MAX_SWEEP_INTERVAL_S, membership.lease_s / 4)
        self._subscriptions = Subscriptions(bus)
        self._sweeper: asyncio.Task[None] | None = None
        self._started = False
        self._draining = False

    async def on_route(self, request: RouteRequest, msg: IncomingMsg) -> None:
        """receive → route (or wait for room) → reply → publish decision."""
        started_s = time.perf_counter()
        with request_context(request.request_id), self.tracer.start_as_current_span("scheduler.route"):
            decision = None if len(self.admission) else self.route(request)  # none jumps the queue
            if decision is None or decision.status is RouteStatus.OVERLOADED:
                if self._can_wait(request) and self.admission.enqueue(request, msg, started_s):
                    self.metrics.queued.set(len(self.admission))
                    return
                decision = decision or overloaded(request, self.scheduler_id, DEFAULT_RETRY_AFTER_S)
            await self._answer(msg, decision, started_s)

    def route(self, request: RouteRequest) -> RouteDecision:
        """The policy's decision over the live members with room; an accepted one counts as in-flight at once."""
        counts = self.in_flight.counts()
        decision = self.policy.pick(request, with_room(self.membership.members(), counts), counts)
        self.in_flight.add(decision)
        if decision.status is RouteStatus.OVERLOADED:
            log.debug("overloaded: %d live workers", len(self.membership))
        return decision

    async def _answer(self, msg: IncomingMsg, decision: RouteDecision, started_s: float) -> None:
        payload = decision.to_bytes()  # once: the same bytes answer the gateway and tell the peers
        await self.bus.reply(msg, payload)
        self.metrics.observe(decision, time.perf_counter() - started_s)
        await self.bus.publish(subjects.decisions(self.model), payload)

    def _can_wait(self, request: RouteRequest) -> bool:
        """Waiting helps only while a live decode worker that could serve the request exists."""
        return any(m.can_decode and not m.draining and serves_model(m, request) for m in self.membership.members())

    def admit_waiting(self) -> None:
        """Route waiting requests, oldest first, while workers have room."""
        while (waiting := self.admission.peek()) is not None:
            decision = self.route(waiting.request)
            if decision.status is RouteStatus.OVERLOADED:
                break
            self.admission.pop()
            self.metrics.queue_time.observe(time.perf_counter() - waiting.started_s)
            self._tasks.spawn(self._answer(waiting.msg, decision, waiting.started_s))
        self.metrics.queued.set(len(self.admission))

    def _on_wait_expired(self, waiting: Waiting) -> None:
        self.metrics.queue_time.observe(time.perf_counter() - waiting.started_s)
        self.metrics.queued.set(len(self.admission))
        decision = overloaded(waiting.request, self.scheduler_id, DEFAULT_RETRY_AFTER_S)
        self._tasks.spawn(self._answer(waiting.msg, decision, waiting.started_s))

    async def on_heartbeat(self, load: WorkerLoad, msg: IncomingMsg) -> None:
        """A worker's WorkerLoad: refresh its membership; its heartbeat now covers older in-flight counts."""
        member, joined = self.membership.observe(load)
        self.in_flight.on_heartbeat(member.worker_id, member.num_received)
        self.kv_feed.on_member(member)
        if len(self.admission):
            self.admit_waiting()
        if joined:
            log.info(
                "worker joined: %s (%s) at %s",
                member.worker_id,
                member.role.value,
                member.data_plane_address,
                extra={"worker_id": member.worker_id, "role": member.role.value},
            )
            self.metrics.set_members(self.membership.count_by_role())

    async def on_peer_decision(self, decision: RouteDecision, msg: IncomingMsg) -> None:
        """Another replica's decision: count its workers' in-flight load (our own are counted already)."""
        if decision.scheduler_id != self.scheduler_id:
            self.in_flight.add(decision)

    def sweep(self) -> None:
        """Drop workers whose lease ran out and in-flight counts past their TTL."""
        for member in self.membership.sweep():
            self.in_flight.forget_worker(member.worker_id)
            self.kv_feed.forget(member.worker_id)
            self.metrics.forget_worker(member.worker_id)
            self.metrics.workers_expired.inc()
            log.warning(
                "worker lost: %s (%s), no heartbeat for %.1f s",
                member.worker_id,
                member.role.value,
                self.membership.lease_s,
                extra={"worker_id": member.worker_id, "role": member.role.value},
            )
        self.in_flight.expire()
        self.kv_feed.sweep()
        self.metrics.set_members(self.membership.count_by_role())
        self.metrics.in_flight.set(self.in_flight.total())
        counts = self.in_flight.counts()
        for member in self.membership.members():
            self.metrics.worker_load.labels(worker_id=member.worker_id).set(worker_load(member, counts))

    # -- lifecycle (deepinfer.service.Handler) --------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe to heartbeats, KV events and peers' decisions; warm up; then take routes; start the sweeper."""
        model, subscriptions = self.model, self._subscriptions
        await self.kv_feed.start()
        await subscriptions.subscribe(
            "heartbeats", subjects.heartbeat_all(model), self.on_heartbeat, message_type=WorkerLoad
        )
        await subscriptions.subscribe(
            "decisions", subjects.decisions(model), self.on_peer_decision, message_type=RouteDecision
        )
        await self._warm_up()
        await subscriptions.subscribe(
            "route", subjects.route(model), self.on_route, queue=subjects.SCHEDULER_QUEUE, message_type=RouteRequest
        )
        self._sweeper = asyncio.create_task(
            self._sweep_forever(), name=f"scheduler-sweep-{self.scheduler_id}"
        )
        self._started = True
        self.metrics.set_members(self.membership.count_by_role())

    async def _warm_up(self) -> None:
        """A replica (re)started beside others learns the workers (a heartbeat round) and pages their snapshots
        before it takes a route request, so it never routes blind; `warm_up_s` bounds each of the two waits."""
        if self.warm_up_s <= 0:
            return
        await asyncio.sleep(self.warm_up_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.kv_feed.wait_synced(), self.warm_up_s)

    async def drain(self, grace_s: float) -> None:
        """Stop being ready; requests waiting for room are answered overloaded (the others are answered within
        their message callback; those already delivered by the bus drain that follows)."""
        self._draining = True
        for waiting in self.admission.clear():
            self._on_wait_expired(waiting)
        await self._tasks.drain(grace_s)

    async def close(self) -> None:
        """Stop the sweeper and unsubscribe (idempotent)."""
        self._started = False
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await self._subscriptions.close()
        await self.kv_feed.close()
        self.admission.clear()  # their timers stop; the requesters time out
        await self._tasks.drain(1.0)

    def is_ready(self) -> bool:
        """Subscribed and not draining; zero workers is fine (requests are answered overloaded)."""
        return self._started and not self._draining

    def not_ready_reason(self) -> str:
        """Why not ready, for /ready."""
        if self._draining:
            return "draining"
        return "" if self._started else "not subscribed yet"

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                self.sweep()
            except Exception:  # a bug in one sweep must not stop membership expiry for good
                log.exception("membership sweep failed")


class SchedulerMetrics:
    """The scheduler's Prometheus metrics on the service's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = counter(registry, "scheduler_decisions", "Route decisions by status.", ["status"])
        self.queued = gauge(registry, "scheduler_admission_queued", "Route requests waiting for a worker with room.")
        self.queue_time = histogram(
            registry, "scheduler_admission_wait_seconds", "Time a route request waited for room (routed or not).",
            buckets=QUEUE_BUCKETS_S,
        )
        self.expected_cached_tokens = counter(
            registry, "scheduler_expected_cached_tokens", "Prompt tokens the decisions expect to find cached."
        )
        self.members = gauge(registry, "scheduler_members", "Live workers by role.", ["role"])
        self.route_latency = histogram(
            registry,
            "scheduler_route_latency_seconds",
            "Route request received to decision replied.",
            buckets=ROUTE_BUCKETS_S,
        )
        self.in_flight = gauge(
            registry, "scheduler_in_flight_decisions", "(worker, request) decisions not yet in heartbeats."
        )
        self.worker_load = gauge(
            registry, "scheduler_worker_load", "Requests running, waiting or in flight per worker, as routed on.",
            ["worker_id"],
        )
        self.workers_expired = counter(
            registry, "scheduler_workers_expired", "Workers dropped after their heartbeat lease ran out."
        )
        for status in RouteStatus:
            self.decisions.labels(status=status.value)

    def observe(self, decision: RouteDecision, latency_s: float) -> None:
        """Count one decision and its latency."""
        self.decisions.labels(status=decision.status.value).inc()
        self.expected_cached_tokens.inc(decision.expected_cached_tokens)
        self.route_latency.observe(latency_s)

    def forget_worker(self, worker_id: str) -> None:
        """A worker left: drop its series."""
        with contextlib.suppress(KeyError):
            self.worker_load.remove(worker_id)

    def set_members(self, counts: dict[WorkerRole, int]) -> None:
        """Publish live members per role."""
        for role, num in counts.items():
            self.members.labels(role=role.value).set(num)


def build_handler(
    settings: SchedulerSettings,
    bus: MessageBus,
    registry: CollectorRegistry,
    *,
    tracer: Tracer | None = None,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
) -> SchedulerHandler:
    """A SchedulerHandler wired from settings (clock and rng injectable for tests)."""
    model = settings.common.served_model_name or settings.common.model
    membership = Membership(settings.worker_lease_s, clock=clock)
    index = KvIndex(settings.kv_index_max_entries)
    return SchedulerHandler(
        model=model,
        scheduler_id=settings.scheduler_id,
        bus=bus,
        membership=membership,
        in_flight=InFlight(clock=clock),
        policy=build_policy(settings, index, rng or random.Random()),
        registry=registry,
        kv_feed=KvIndexFeed(model, bus, index, membership, registry, settings.snapshot_timeout_s, clock=clock),
        tracer=tracer,
        max_queued=settings.admission_queue_size,
        max_wait_s=settings.admission_wait_s,
        warm_up_s=settings.warm_up_s,
    )


def build_policy(settings: SchedulerSettings, index: KvIndex, rng: random.Random) -> RoutingPolicy:
    """The policy `settings.routing_policy` names."""
    if settings.routing_policy == "round_robin":
        return RoundRobinPolicy(settings.scheduler_id)
    if settings.routing_policy == "least_loaded":
        return LeastLoadedPolicy(settings.scheduler_id, rng=rng)
    weights = CostWeights(
        load_weight=settings.load_weight,
        kv_usage_weight=settings.kv_usage_weight,
        direct_decode_min_fraction=settings.direct_decode_min_fraction,
    )
    return PrefixPolicy(settings.scheduler_id, index, weights, rng=rng)
