"""deepinfer.bench.metrics: TTFT, ITL, TPOT, E2E and throughput from known arrival times; deepinfer.bench.cost: $
per million tokens from known GPU time and token counts."""

import math

import pytest

from deepinfer.bench.cost import Weights, cost, cost_table, per_gpu
from deepinfer.bench.metrics import RequestRecord, percentile, summarize
from deepinfer.bench.report import flat


def test_percentile_interpolates_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5 and percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))


def test_known_arrival_times_give_known_figures():
    # request a: sent at 0, chunks at 0.1, 0.2, 0.4, ends at 0.4, 3 tokens
    # request b: sent at 0, chunks at 0.3, 0.4, ends at 0.5 (the usage chunk after the last text), 2 tokens
    # request c: sent at 0.5, failed
    a = RequestRecord(sent_s=0.0, chunk_s=[0.1, 0.2, 0.4], end_s=0.4, output_tokens=3, prompt_tokens=10)
    b = RequestRecord(
        sent_s=0.0, chunk_s=[0.3, 0.4], end_s=0.5, output_tokens=2, prompt_tokens=10, cached_tokens=8
    )
    c = RequestRecord(sent_s=0.5, end_s=0.6, error="HTTP 503: overloaded")
    s = summarize([a, b, c], wall_s=1.0)
    assert (
        s["num_requests"],
        s["num_failed"],
        s["output_tokens"],
        s["prompt_tokens"],
        s["cached_tokens"],
    ) == (3, 1, 5, 20, 8)
    assert s["output_tok_s"] == 5.0 and s["requests_per_s"] == 2.0
    assert s["output_tok_s_per_user"] == pytest.approx((3 / 0.4 + 2 / 0.5) / 2, abs=1e-3)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(100 + 200 * 0.99)
    # ITL pools every gap: a 0.1, 0.2; b 0.1
    assert s["itl_ms"]["mean"] == pytest.approx(400 / 3, abs=1e-3) and s["itl_ms"]["p50"] == pytest.approx(
        100.0
    )
    # TPOT: a (0.4 - 0.1) / 2 = 0.15, b (0.5 - 0.3) / 1 = 0.2
    assert s["tpot_ms"]["mean"] == pytest.approx(175.0)
    assert s["e2e_ms"]["mean"] == pytest.approx(450.0)


def test_a_one_token_answer_has_no_tpot_and_nothing_completed_gives_nan():
    one = RequestRecord(sent_s=0.0, chunk_s=[0.1], end_s=0.1, output_tokens=1)
    assert math.isnan(one.tpot_s) and one.itl_s() == []
    s = summarize([RequestRecord(sent_s=0.0, end_s=1.0, error="x")], wall_s=1.0)
    assert s["num_failed"] == 1 and math.isnan(s["ttft_ms"]["p50"]) and s["output_tok_s"] == 0.0


def test_csv_names_join_nested_figures():
    assert flat({"concurrency": 4, "ttft_ms": {"p99": 1.5}}) == {"concurrency": 4, "ttft_ms_p99": 1.5}


def test_the_cost_of_a_point_is_its_gpu_time_spread_over_its_tokens():
    # 2 GPUs at $3.60/h for 1000 s: $2.00; 1M uncached + 1M cached input tokens, 0.5M output tokens
    point = {
        "concurrency": 8,
        "wall_s": 1000.0,
        "prompt_tokens": 2_000_000,
        "cached_tokens": 1_000_000,
        "output_tokens": 500_000,
        "output_tok_s": 500.0,
    }
    c = cost(point, gpu_hour_usd=3.6, gpus=2, weights=Weights(cached_input=0.1, output=4.0))
    assert c["cost_usd"] == pytest.approx(2.0)
    # units: 1M + 0.1 × 1M + 4 × 0.5M = 3.1M; $2.00 / 3.1 per million uncached
    assert c["usd_per_m_input_uncached"] == pytest.approx(2 / 3.1, abs=1e-6)
    assert c["usd_per_m_input_cached"] == pytest.approx(0.2 / 3.1, abs=1e-6)
    assert c["usd_per_m_output"] == pytest.approx(8 / 3.1, abs=1e-6)
    revenue = sum(
        c[k] * n / 1e6
        for k, n in (
            ("usd_per_m_input_uncached", 1e6),
            ("usd_per_m_input_cached", 1e6),
            ("usd_per_m_output", 5e5),
        )
    )
    assert revenue == pytest.approx(c["cost_usd"])  # the price list pays exactly for the GPU time
    assert c["usd_per_m_output_all_in"] == pytest.approx(4.0)  # $2.00 / 0.5M
    assert per_gpu(point, 2) == {"output_tok_s_per_gpu": 250.0}
    point["concurrency"], point["cost"], point["output_tok_s_per_gpu"] = 8, c, 250.0
    assert "c=8" in cost_table([point]) and "2.581" in cost_table([point])
    assert math.isnan(cost(point | {"output_tokens": 0}, 1.0, 1)["usd_per_m_output_all_in"])
