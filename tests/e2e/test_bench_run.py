"""`deepinfer bench run` against the stack (a short sweep): the JSON follows its schema, the CSV has one row per
point, every request completed with the tokens the server reported, and `bench compare` reads two runs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from deepinfer.up import Stack

pytestmark = pytest.mark.e2e


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.cli", "bench", *args], capture_output=True, text=True,
                          timeout=300)


def test_a_short_sweep_writes_json_and_csv_that_compare_reads(stack: Stack, tmp_path):
    server = stack.base_url.removesuffix("/v1")
    out, table = tmp_path / "run.json", tmp_path / "run.csv"
    run = bench("run", "--base-url", server, "--concurrency", "1,2", "--num-prompts", "4", "--input-words", "40",
                "--max-tokens", "8", "--ignore-eos", "--out", str(out), "--csv", str(table))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["bench"] == "deepinfer-bench-run" and result["schema"] == 1 and result["model"] == stack.model_name
    assert [p["concurrency"] for p in result["points"]] == [1, 2]
    for point in result["points"]:
        assert (point["num_requests"], point["num_failed"], point["output_tokens"]) == (4, 0, 32)  # ignore_eos
        assert point["prompt_tokens"] > 4 * 40 // 2 and point["output_tok_s"] > 0
        assert 0 < point["ttft_ms"]["p50"] <= point["e2e_ms"]["p50"] and point["itl_ms"]["p50"] > 0
    rows = list(csv.DictReader(table.open()))
    assert [row["concurrency"] for row in rows] == ["1", "2"] and "ttft_ms_p99" in rows[0]
    same = bench("compare", "--tolerance", "100", str(out), str(out))
    assert same.returncode == 0 and "points.c=2.output_tok_s" in same.stdout


def test_an_unreachable_server_is_a_clear_error(tmp_path):
    run = bench("run", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path / "x.json"))
    assert run.returncode == 2 and "cannot list the models of http://127.0.0.1:9" in run.stderr
