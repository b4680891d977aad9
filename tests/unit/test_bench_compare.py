"""deepinfer.bench.compare: which numbers are figures, which way is better, what counts as worse."""

import json

import pytest

from deepinfer.bench.compare import Delta, compare, direction, figures, table
from deepinfer.cli import main


def test_direction_from_the_figures_name():
    assert direction("prefill.ours_tok_s") == 1
    assert direction("ceilings.copy_gb_s") == 1
    assert direction("decode.64.graphs_of_roofline") == 1
    assert direction("points.service_over_offline") == 1
    assert direction("points.c=4.requests_per_s") == 1  # a rate, not a duration ("_s")
    assert direction("decode.64.graphs_step_ms") == -1
    assert direction("prefill.attention_s") == -1
    assert direction("offline_ttft_ms_p99") == -1
    assert direction("decode.64.graph_bucket") == 0
    assert direction("layers") == 0
    # a bench run's nested distributions and prices
    assert direction("points.c=4.ttft_ms.p99") == -1 and direction("points.rate=2.itl_ms.mean") == -1
    assert direction("points.c=4.cost.usd_per_m_output") == -1
    assert direction("p99") == 0 and direction("points.c=4.turns.turn=1.cached_fraction") == 0


def test_figures_are_numeric_leaves_under_dicts():
    result = {"layers": 32, "ok": True, "sizes": [1, 2], "name": "x", "decode": {"64": {"tok_s": 5.0}}}
    assert dict(figures(result)) == {"layers": 32.0, "decode.64.tok_s": 5.0}


def test_worse_by_direction_and_tolerance():
    faster = Delta("tok_s", 100.0, 96.0, 1, False)
    assert faster.worse(0.03) and not faster.worse(0.05)
    assert not Delta("tok_s", 100.0, 120.0, 1, False).worse()
    assert Delta("step_ms", 10.0, 10.4, -1, False).worse(0.03)
    assert not Delta("step_ms", 10.0, 9.0, -1, False).worse()
    assert not Delta("ceilings.copy_gb_s", 100.0, 50.0, 1, True).worse()  # the machine, not the code


def test_compare_keeps_common_figures_and_marks_the_machines():
    before = {
        "ceilings": {"copy_gb_s": 4000},
        "prefill": {"ours_tok_s": 100, "limit_tok_s": 150},
        "old": {"x_ms": 1},
    }
    after = {
        "ceilings": {"copy_gb_s": 3900},
        "prefill": {"ours_tok_s": 90, "limit_tok_s": 140},
        "new": {"y_ms": 2},
    }
    deltas = {d.name: d for d in compare(before, after)}
    assert set(deltas) == {"ceilings.copy_gb_s", "prefill.ours_tok_s", "prefill.limit_tok_s"}
    assert deltas["ceilings.copy_gb_s"].machine and deltas["prefill.limit_tok_s"].machine
    assert deltas["prefill.ours_tok_s"].ratio == pytest.approx(0.9)
    text = table(list(deltas.values()))
    assert "prefill.ours_tok_s" in text and "WORSE" in text and "(machine)" in text


def test_cli_exit_status(tmp_path, capsys):
    before, same, slower = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    before.write_text(json.dumps({"decode": {"tok_s": 100.0}}))
    same.write_text(json.dumps({"decode": {"tok_s": 99.0}}))
    slower.write_text(json.dumps({"decode": {"tok_s": 80.0}}))
    assert main(["bench", "compare", str(before), str(same)]) == 0
    assert main(["bench", "compare", str(before), str(slower)]) == 1
    assert "decode.tok_s" in capsys.readouterr().out
    assert main(["bench", "compare", str(before), str(tmp_path / "missing.json")]) == 2
    assert main(["bench", "compare", "--tolerance", "0.25", str(before), str(slower)]) == 0
