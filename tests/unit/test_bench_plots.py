"""deepinfer.bench.plots: the Pareto front over a sweep, and the three PNGs of one or two results (skipped where
matplotlib, the `deepinfer[bench]` extra, is not installed); deepinfer.bench.metrics.quantiles_ms for the CDFs."""

import math

import pytest

from deepinfer.bench.metrics import quantiles_ms
from deepinfer.bench.plots import pareto_front


def test_the_pareto_front_keeps_the_points_nothing_beats_on_both_axes():
    # (tok/s per user, tok/s per GPU): c=1 is fastest per user, c=16 most per GPU; c=8 is beaten by c=16 on both
    xy = [(50.0, 40.0), (30.0, 100.0), (10.0, 150.0), (12.0, 160.0), (5.0, 120.0)]
    assert pareto_front(xy) == [3, 1, 0]  # in order of x
    assert pareto_front([(1.0, 1.0), (1.0, 1.0)]) == [0]  # a repeated point once
    assert pareto_front([(math.nan, 5.0), (None, 1.0), (1.0, 1.0)]) == [2]
    assert pareto_front([]) == []


def test_quantiles_run_from_the_minimum_to_the_maximum_in_ms():
    q = quantiles_ms([0.004, 0.001, 0.003, 0.002], num=5)
    assert q == [1.0, 1.75, 2.5, 3.25, 4.0]
    assert quantiles_ms([]) == [] and len(quantiles_ms([0.1])) == 101


def _result(scale: float) -> dict:
    points = [
        {
            "concurrency": c,
            "output_tok_s": scale * 10 * c,
            "output_tok_s_per_gpu": scale * 10 * c,
            "output_tok_s_per_user": 100.0 / c,
            "ttft_ms": {"p50": 5.0 * c},
            "cdf_ms": {
                "ttft": quantiles_ms([0.001 * c * i for i in range(1, 20)]),
                "itl": quantiles_ms([0.01] * 3),
            },
        }
        for c in (1, 4, 16)
    ]
    return {"bench": "deepinfer-bench-run", "points": points}


def test_one_run_and_two_runs_draw_three_valid_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from deepinfer.bench.plots import draw

    for results in ([("a", _result(1.0))], [("before", _result(1.0)), ("after", _result(1.5))]):
        paths = draw(results, tmp_path / f"run{len(results)}")
        assert [p.name for p in paths] == [
            f"run{len(results)}-{n}.png" for n in ("pareto", "cdf", "throughput")
        ]
        for path in paths:
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
