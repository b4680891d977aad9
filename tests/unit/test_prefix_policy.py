"""PrefixPolicy's cost with exact numbers (tiers, load, the shared system prompt), RoundRobinPolicy, and the
handler feeding its KV index from events and snapshots on a FakeBus."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from deepinfer import subjects
from deepinfer.config import CommonSettings, SchedulerSettings
from deepinfer.hashing import hash_blocks
from deepinfer.protocol import (
    KvEvent,
    KvEventBatch,
    KvEventKind,
    KvStoreEventBatch,
    KvTier,
    RouteDecision,
    RouteRequest,
    RouteStatus,
    SnapshotPage,
    SnapshotRequest,
    WorkerRole,
)
from deepinfer.telemetry import new_registry
from deepinfer.testing import FakeBroker, FakeBus
from services.scheduler.handler import build_handler
from services.scheduler.kv_index import KvIndex
from services.scheduler.policy import RoundRobinPolicy
from services.scheduler.prefix_policy import CostWeights, PrefixPolicy
from tests.unit.test_scheduler_policy import FP, heartbeat, member

P, D, B = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH
BS = 16
MIB = 1 << 20


def hashes(tokens: list[int]) -> list[bytes]:
    return hash_blocks(tokens, BS, FP, "")


def route(request_id: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(
        request_id=request_id, gateway_id="g1", block_hashes=hashes(tokens), num_prompt_tokens=len(tokens),
        model_fingerprint=FP,
    )


def index_with(holdings: dict[str, list[bytes]], lower: dict[str, list[bytes]] | None = None) -> KvIndex:
    index = KvIndex()
    for worker, held in holdings.items():
        index.observe_worker(worker, "L", "e")
        index.begin_snapshot(worker)
        index.apply_page(SnapshotPage(worker_id=worker, seq=0, block_hashes=held, epoch="e"))
        index.end_snapshot(worker)
    for worker, held in (lower or {}).items():
        event = KvEvent(event_kind=KvEventKind.STORED, block_hashes=held, tier=KvTier.HOST)
        index.apply_batch(KvEventBatch(worker_id=worker, seq=1, events=[event], ts=0.0, epoch="e"))
    return index


PROMPT = list(range(100, 228))  # 128 tokens = 8 blocks


def test_a_worker_without_measured_costs_gets_the_legacy_tier_weights():
    blocks = hashes(PROMPT)
    index = index_with({"p1": blocks[:4], "p2": blocks[:2]}, lower={"p2": blocks[2:6]})
    index.apply_store_batch(KvStoreEventBatch(shard="s", seq=1, layout_id="L", stored_block_hashes=blocks[:7], ts=0))
    policy = PrefixPolicy("s1", index, CostWeights(load_weight=0.5, kv_usage_weight=1))
    members = [member("p1", P, running=1), member("p2", P, num_free_blocks=75), member("d1", D)]
    scored = {s.member.worker_id: s.cost for s in policy.score(route("r", PROMPT), members, {"p1": 1})}
    # p1: 4 device + 0.5 × 3 store blocks = 16 × 5.5 = 88 credit → 40 left; load 0.5 × 2 requests × 128 = 128
    # p2: 2 device + 0.8 × 4 host + 0.5 × 1 store = 16 × 5.7 = 91.2 → 36.8 left; KV 25% used × 128 = 32
    # d1: 0.5 × 7 store blocks = 56 credit → 72 left
    assert scored == pytest.approx({"p1": 40 + 128, "p2": 36.8 + 32, "d1": 72})
    decision = policy.pick(route("r", PROMPT), members, {"p1": 1})
    assert decision == RouteDecision(
        request_id="r", status=RouteStatus.ACCEPTED, prefill_worker_id="p2", decode_worker_id="d1",
        expected_cached_tokens=112, scheduler_id="s1",
    )


def measured(prefill_tokens_per_s: float = 16_000.0, host: float | None = None, store: float | None = None) -> dict:
    """Heartbeat fields of a worker reporting its costs: 2 MiB blocks of 16 tokens, 1 ms to compute one."""
    return {"kv_bytes_per_block": 2 * MIB, "prefill_tokens_per_s": prefill_tokens_per_s,
            "host_load_bytes_per_s": host, "store_load_bytes_per_s": store}


def test_the_credit_is_the_time_a_prefix_saves_at_each_workers_own_rates():
    blocks = hashes(PROMPT)
    index = index_with({"p1": blocks[:2], "p2": blocks[:2]}, lower={"p1": blocks[2:4]})
    index.apply_store_batch(KvStoreEventBatch(shard="s", seq=1, layout_id="L", stored_block_hashes=blocks[:7], ts=0))
    policy = PrefixPolicy("s1", index, CostWeights(load_weight=0.5, kv_usage_weight=0))
    members = [
        member("p1", P, **measured(host=8 * MIB * 1000, store=4 * MIB * 1000)),  # host 0.25 ms, store 0.5 ms a block
        member("p2", P, **measured(host=8 * MIB * 1000, store=1 * MIB * 1000)),  # a store slower than computing
        member("d1", D, **measured(store=4 * MIB * 1000)),  # a fast (same-host shared memory) store
        member("d2", D, **measured(store=1 * MIB * 1000)),  # the data plane: 2 ms a block
    ]
    scored = {s.member.worker_id: s.cost for s in policy.score(route("r", PROMPT), members, {})}
    # a loaded block saves 16 tokens less the 16 tokens a ms computes while it loads:
    # p1: 2 device (32) + 2 host (2 × 12) + 3 store (3 × 8) = 80 → 48 left
    # p2: 2 device (32), its 5 store blocks recomputed → 96 left
    # d1: 7 store blocks (7 × 8 = 56) → 72 left; d2: nothing worth loading → 128
    assert scored == pytest.approx({"p1": 48, "p2": 96, "d1": 72, "d2": 128})
    decision = policy.pick(route("r", PROMPT), members, {})
    assert (decision.prefill_worker_id, decision.decode_worker_id, decision.expected_cached_tokens) == (
        "p1", "d1", 112)


def test_expected_cached_tokens_count_only_the_part_worth_loading():
    blocks = hashes(PROMPT)
    index = index_with({"d1": blocks[:3]})
    index.apply_store_batch(KvStoreEventBatch(shard="s", seq=1, layout_id="L", stored_block_hashes=blocks[:7], ts=0))
    policy = PrefixPolicy("s1", index, CostWeights(load_weight=0.5, kv_usage_weight=0))
    decision = policy.pick(route("r", PROMPT), [member("d1", B, **measured(store=1 * MIB * 1000))], {})
    assert (decision.prefill_worker_id, decision.expected_cached_tokens) == (None, 48)  # its 3 device blocks


def test_the_cached_prefix_wins_at_equal_load():
    blocks = hashes(PROMPT)
    policy = PrefixPolicy("s1", index_with({"p2": blocks[:5]}), rng=random.Random(0))
    members = [member("p1", P), member("p2", P), member("p3", P), member("d1", D)]
    for seed in range(10):
        policy.rng = random.Random(seed)
        decision = policy.pick(route("r", PROMPT), members, {})
        assert (decision.prefill_worker_id, decision.expected_cached_tokens) == ("p2", 80)


def test_a_shared_system_prompt_spreads_once_its_worker_is_busier_than_the_saving():
    system = list(range(1000, 1096))  # 96 tokens = 6 blocks every request carries
    index = index_with({"p1": hashes(system)})
    policy = PrefixPolicy("s1", index, CostWeights(load_weight=0.5), rng=random.Random(0))
    members = [member("p1", P), member("p2", P), member("d1", D)]
    in_flight: Counter[str] = Counter()
    chosen = []
    for i in range(12):  # a burst: nothing finishes, so each decision is in flight for the next
        prompt = system + [5000 + i] * 32  # 128 tokens, 96 of them cached on p1
        decision = policy.pick(route(f"r{i}", prompt), members, in_flight)
        chosen.append(decision.prefill_worker_id)
        in_flight[decision.prefill_worker_id] += 1
    # p1 saves 96 of 128 tokens = 0.75 prompt; a request ahead costs 0.5: p1 wins while it has < 1.5 more.
    assert chosen[:4] == ["p1", "p1", "p2", "p1"]
    assert Counter(chosen) == {"p1": 7, "p2": 5}


def test_a_decode_worker_holding_nearly_all_the_prompt_computes_it_itself():
    blocks = hashes(PROMPT)
    policy = PrefixPolicy("s1", index_with({"d1": blocks[:8], "p1": blocks[:8], "d2": blocks[:7]}))
    members = [member("p1", P), member("d1", D, running=1), member("d2", D)]
    # d1: 0 left + 64 load; d2: 16 left + 0 → d2, which holds 7/8 < 0.9 of the blocks: p1 prefills
    decision = policy.pick(route("r", PROMPT), members, {})
    assert (decision.prefill_worker_id, decision.decode_worker_id, decision.expected_cached_tokens) == (
        "p1", "d2", 128,
    )
    policy.weights = CostWeights(direct_decode_min_fraction=0.85)
    decision = policy.pick(route("r", PROMPT), members, {})
    assert (decision.prefill_worker_id, decision.decode_worker_id, decision.expected_cached_tokens) == (
        None, "d2", 112,
    )


def test_prefix_policy_admission_rules_match_least_loaded():
    policy = PrefixPolicy("s1", KvIndex(), rng=random.Random(0))
    assert policy.pick(route("r", PROMPT), [member("p1", P)], {}).status is RouteStatus.OVERLOADED
    full = {"num_free_blocks": 0, "num_total_blocks": 64}
    decision = policy.pick(route("r", PROMPT), [member("p1", P), member("d1", D, **full), member("d2", D)], {})
    assert decision.decode_worker_id == "d2"
    alone = policy.pick(route("r", PROMPT), [member("b1", B)], {})
    assert (alone.prefill_worker_id, alone.decode_worker_id) == (None, "b1")


def test_round_robin_takes_turns_per_side():
    policy = RoundRobinPolicy("s1")
    members = [member("d1", D), member("d2", D), member("p1", P), member("p2", P), member("p3", P)]
    pairs = [(d.prefill_worker_id, d.decode_worker_id) for d in (policy.pick(route(f"r{i}", PROMPT), members, {})
                                                                  for i in range(4))]
    assert pairs == [("p1", "d1"), ("p2", "d2"), ("p3", "d1"), ("p1", "d2")]


async def test_handler_pages_snapshots_follows_events_and_credits_the_prefix():
    broker = FakeBroker()
    settings = SchedulerSettings(common=CommonSettings(served_model_name="m"), scheduler_id="sched-a")
    handler = build_handler(settings, FakeBus(broker, "sched"), new_registry(False), rng=random.Random(1))
    await handler.start()
    worker = FakeBus(broker, "worker")
    blocks = hashes(PROMPT)
    asked: list[SnapshotRequest] = []

    def snapshot_server(worker_id: str, held: list[bytes]):
        async def on_request(request: SnapshotRequest, msg) -> None:
            asked.append(request)
            page = held[request.cursor : request.cursor + 2]
            end = request.cursor + 2
            await worker.reply(msg, SnapshotPage(
                worker_id=worker_id, seq=3, block_hashes=page, next_cursor=end if end < len(held) else None,
                epoch="e1", cursor=request.cursor,
            ))
        return on_request

    await worker.subscribe(subjects.snapshot("m", "p1"), snapshot_server("p1", blocks[:3]), message_type=SnapshotRequest)
    await worker.subscribe(subjects.snapshot("m", "p2"), snapshot_server("p2", []), message_type=SnapshotRequest)
    await worker.subscribe(subjects.snapshot("m", "d1"), snapshot_server("d1", []), message_type=SnapshotRequest)
    for worker_id, role in [("p1", P), ("p2", P), ("d1", D)]:
        await worker.publish(subjects.heartbeat("m", worker_id), heartbeat(worker_id, role, epoch="e1"))
    await broker.settle()
    await handler.kv_feed.wait_synced()
    assert sorted((r.cursor, r.seq or 0) for r in asked) == [(0, 0), (0, 0), (0, 0), (2, 3)]
    # seq 4 on p2 adds the prompt's first 5 blocks: p2 now has the longer prefix
    event = KvEvent(event_kind=KvEventKind.STORED, block_hashes=blocks[:5])
    await worker.publish(subjects.kv_events("m", "p2"), KvEventBatch(worker_id="p2", seq=4, events=[event], ts=0,
                                                                      epoch="e1"))
    await broker.settle()
    decision = handler.route(route("r1", PROMPT))
    assert (decision.prefill_worker_id, decision.expected_cached_tokens) == ("p2", 80)
    handler.sweep()
    assert handler.kv_feed.metrics.entries._value.get() == 8
    assert handler.metrics.worker_load.labels(worker_id="p2")._value.get() == 1  # r1, in flight
    # p2 restarts: a new epoch in its heartbeat drops its blocks (its snapshot is now empty)
    await worker.publish(subjects.heartbeat("m", "p2"), heartbeat("p2", P, epoch="e2"))
    await broker.settle()
    assert handler.kv_feed.index.holders("L", blocks[0]) == {"p1": "device"}
    await handler.close()


async def test_admission_waits_for_room_then_routes_oldest_first_or_answers_overloaded():
    broker = FakeBroker()
    settings = SchedulerSettings(common=CommonSettings(served_model_name="m"), scheduler_id="sched-a",
                                 admission_queue_size=2, admission_wait_s=0.3)
    handler = build_handler(settings, FakeBus(broker, "sched"), new_registry(False), rng=random.Random(1))
    await handler.start()
    client = FakeBus(broker, "client")
    full = heartbeat("d1", D, max_num_seqs=2, num_received=0, epoch="e")
    await client.publish(subjects.heartbeat("m", "d1"), full)
    await broker.settle()

    async def ask(request_id: str) -> RouteDecision:
        return await client.request(subjects.route("m"), route(request_id, PROMPT), RouteDecision, timeout_s=2.0)

    first = [await ask("r1"), await ask("r2")]
    assert [d.status for d in first] == [RouteStatus.ACCEPTED] * 2
    waiting = [asyncio.create_task(ask(f"w{i}")) for i in range(3)]
    # the third is answered while the first two still wait (their 0.3 s has not run out): the queue was full
    assert (await waiting[2]).status is RouteStatus.OVERLOADED
    assert len(handler.admission) == 2 and not waiting[0].done()
    # d1's heartbeat: both requests arrived, one still running: room for one more
    await client.publish(subjects.heartbeat("m", "d1"),
                         heartbeat("d1", D, max_num_seqs=2, num_received=2, num_running=1, epoch="e"))
    routed = await waiting[0]
    assert (routed.status, routed.decode_worker_id) == (RouteStatus.ACCEPTED, "d1")
    expired = await waiting[1]  # no more room within admission_wait_s
    assert expired.status is RouteStatus.OVERLOADED and expired.retry_after_s == 1.0
    assert len(handler.admission) == 0
    # no live decode worker: overloaded at once, nothing waits
    handler.membership = type(handler.membership)(settings.worker_lease_s)
    handler.admission.max_wait_s = 60.0  # a wait would outlast ask's 2 s timeout
    assert (await ask("r9")).status is RouteStatus.OVERLOADED
    assert len(handler.admission) == 0
    await handler.close()
