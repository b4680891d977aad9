"""Fail-open routing: with no scheduler answering, the gateway routes from its own heartbeat table (least loaded,
its own recent decisions counted), counts it, and a scheduler that answers is always preferred."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.membership import Membership
from deepinfer.protocol import RouteRequest, RouteStatus, WorkerRole
from deepinfer.testing.checkpoints import write_tokenizer_dir
from deepinfer.testing.fake_workers import PREFILL_ID, worker_load
from services.gateway.fallback_routing import FallbackRouter
from tests.gateway_harness import ANSWER, MODEL, make_harness

MESSAGES = [{"role": "user", "content": "Hi there"}]


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _request(request_id: str = "r", **fields) -> RouteRequest:
    return RouteRequest(request_id=request_id, gateway_id="gw", block_hashes=[], num_prompt_tokens=10, **fields)


def test_least_loaded_decode_and_a_prefill_of_its_layout():
    clock = Clock()
    membership = Membership(3.0, clock)
    membership.observe(worker_load("decode-0", WorkerRole.DECODE, num_running=4))
    membership.observe(worker_load("decode-1", WorkerRole.DECODE, num_running=1))
    membership.observe(worker_load("prefill-0", WorkerRole.PREFILL, layout_id="other"))
    membership.observe(worker_load("prefill-1", WorkerRole.PREFILL))
    membership.observe(worker_load("decode-2", WorkerRole.DECODE, draining=True))
    decision = FallbackRouter(membership, "gw").route(_request())
    assert decision.status is RouteStatus.ACCEPTED
    assert (decision.prefill_worker_id, decision.decode_worker_id, decision.scheduler_id) == (
        "prefill-1", "decode-1", "gw")


def test_its_own_decisions_count_until_the_next_heartbeat():
    clock = Clock()
    membership = Membership(3.0, clock)
    membership.observe(worker_load("decode-0", WorkerRole.DECODE, num_running=2))
    membership.observe(worker_load("decode-1", WorkerRole.DECODE, num_running=0))
    router = FallbackRouter(membership, "gw")
    picks = [router.route(_request(f"r{i}")).decode_worker_id for i in range(4)]
    assert picks[:2] == ["decode-1", "decode-1"] and sorted(picks[2:]) == ["decode-0", "decode-1"]
    clock.now_s += 1.0
    membership.observe(worker_load("decode-1", WorkerRole.DECODE, num_running=0))  # its heartbeat shows it idle
    assert router.route(_request("r5")).decode_worker_id == "decode-1"


def test_no_live_decode_worker_is_overloaded():
    clock = Clock()
    membership = Membership(3.0, clock)
    membership.observe(worker_load("decode-0", WorkerRole.DECODE))
    clock.now_s += 3.0  # its lease ran out
    assert FallbackRouter(membership, "gw").route(_request()).status is RouteStatus.OVERLOADED


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


async def test_with_the_scheduler_gone_requests_are_served_and_counted(model_dir: Path):
    h = await make_harness(model_dir)
    await h.fake.heartbeat()
    await h.fake.bus.broker.settle()
    await h.fake.stop_scheduler()
    client = h.openai()
    reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert reply.choices[0].message.content == text == ANSWER
    assert h.fake.route_requests == []  # nobody was asked: NoResponders at once
    # each went prefill-0 → decode-0, as the scheduler would route them
    assert len(h.fake.prefill_requests) == len(h.fake.decode_requests) == 2
    assert all(r.prefill_worker_id == PREFILL_ID for r in h.fake.decode_requests)
    value = h.gateway.state.metrics.registry.get_sample_value(
        "deepinfer_gateway_fallback_routes_total", {"reason": "no_scheduler"})
    assert value == 2
    await h.fake.stop()


async def test_with_the_fallback_off_no_scheduler_is_a_503(model_dir: Path):
    h = await make_harness(model_dir, settings={"route_fallback": False})
    await h.fake.heartbeat()
    await h.fake.bus.broker.settle()
    await h.fake.stop_scheduler()
    async with h.http() as http:
        response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert response.status_code == 503 and "no scheduler" in response.json()["error"]["message"]
    assert h.gateway.pipeline.fallback is None
    await h.fake.stop()


async def test_a_scheduler_that_answers_is_always_asked_first(model_dir: Path):
    h = await make_harness(model_dir)
    await h.fake.heartbeat()
    await h.fake.bus.broker.settle()
    reply = await h.openai().chat.completions.create(model=MODEL, messages=MESSAGES)
    assert reply.choices[0].message.content == ANSWER
    assert len(h.fake.route_requests) == 1
    assert h.gateway.state.metrics.registry.get_sample_value(
        "deepinfer_gateway_fallback_routes_total", {"reason": "no_scheduler"}) in (None, 0)
    await h.fake.stop()
