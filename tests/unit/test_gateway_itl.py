"""The gateway's inter-token latency (RequestRecord.delivered): each token after a choice's first delivery is one
observation, a delivery's gap shared by the tokens that came in it, choices timed apart, TTFT at the first."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

import services.gateway.metrics as gateway_metrics
from services.gateway.metrics import GatewayMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(gateway_metrics.time, "monotonic", clock)
    return clock


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"route": "chat", **labels}) or 0.0


def test_a_delivery_s_gap_is_shared_by_its_tokens_and_choices_are_timed_apart(clock: Clock) -> None:
    registry = CollectorRegistry()
    record = GatewayMetrics(registry).begin("chat")
    clock.now += 0.5
    record.delivered(0, 1)  # choice 0's first token: TTFT 0.5 s, no ITL yet
    clock.now += 0.1
    record.delivered(1, 2)  # choice 1's first delivery (2 tokens): no ITL either
    clock.now += 0.2
    record.delivered(0, 5)  # 4 tokens 0.3 s after choice 0's first: 4 observations of 0.075 s
    clock.now += 0.05
    record.delivered(1, 3)  # 1 token 0.25 s after choice 1's first
    record.delivered(1, 3)  # text with no new token (a held character released): nothing
    assert sample(registry, "deepinfer_gateway_ttft_seconds_count") == 1
    assert sample(registry, "deepinfer_gateway_ttft_seconds_sum") == pytest.approx(0.5)
    assert sample(registry, "deepinfer_gateway_itl_seconds_count") == 5
    assert sample(registry, "deepinfer_gateway_itl_seconds_sum") == pytest.approx(4 * 0.075 + 0.25)
    assert sample(registry, "deepinfer_gateway_itl_seconds_bucket", le="0.1") == 4
    assert sample(registry, "deepinfer_gateway_itl_seconds_bucket", le="0.25") == 5


def test_one_token_per_delivery_observes_each_gap(clock: Clock) -> None:
    registry = CollectorRegistry()
    record = GatewayMetrics(registry).begin("chat")
    for num_tokens in range(1, 11):
        clock.now += 0.02
        record.delivered(0, num_tokens)
    assert sample(registry, "deepinfer_gateway_itl_seconds_count") == 9
    assert sample(registry, "deepinfer_gateway_itl_seconds_sum") == pytest.approx(9 * 0.02)
