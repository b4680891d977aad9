"""deepinfer.bench.metrics: TTFT, ITL, TPOT, E2E and throughput from known arrival times."""

import math

import pytest

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
    b = RequestRecord(sent_s=0.0, chunk_s=[0.3, 0.4], end_s=0.5, output_tokens=2, prompt_tokens=10, cached_tokens=8)
    c = RequestRecord(sent_s=0.5, end_s=0.6, error="HTTP 503: overloaded")
    s = summarize([a, b, c], wall_s=1.0)
    assert (s["num_requests"], s["num_failed"], s["output_tokens"], s["prompt_tokens"], s["cached_tokens"]) == (
        3, 1, 5, 20, 8)
    assert s["output_tok_s"] == 5.0 and s["requests_per_s"] == 2.0
    assert s["output_tok_s_per_user"] == pytest.approx((3 / 0.4 + 2 / 0.5) / 2, abs=1e-3)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(100 + 200 * 0.99)
    # ITL pools every gap: a 0.1, 0.2; b 0.1
    assert s["itl_ms"]["mean"] == pytest.approx(400 / 3, abs=1e-3) and s["itl_ms"]["p50"] == pytest.approx(100.0)
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
