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
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "bench", *args], capture_output=True, text=True, timeout=300
    )


def test_a_short_sweep_writes_json_and_csv_that_compare_reads(stack: Stack, tmp_path):
    server = stack.base_url.removesuffix("/v1")
    out, table = tmp_path / "run.json", tmp_path / "run.csv"
    run = bench(
        "run",
        "--base-url",
        server,
        "--concurrency",
        "1,2",
        "--num-prompts",
        "4",
        "--input-words",
        "40",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--out",
        str(out),
        "--csv",
        str(table),
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert (
        result["bench"] == "deepinfer-bench-run"
        and result["schema"] == 2
        and result["model"] == stack.model_name
    )
    assert [p["concurrency"] for p in result["points"]] == [1, 2]
    for point in result["points"]:
        assert (point["num_requests"], point["num_failed"], point["output_tokens"]) == (
            4,
            0,
            32,
        )  # ignore_eos
        assert point["prompt_tokens"] > 4 * 40 // 2 and point["output_tok_s"] > 0
        assert 0 < point["ttft_ms"]["p50"] <= point["e2e_ms"]["p50"] and point["itl_ms"]["p50"] > 0
    rows = list(csv.DictReader(table.open()))
    assert [row["concurrency"] for row in rows] == ["1", "2"] and "ttft_ms_p99" in rows[0]
    same = bench("compare", "--tolerance", "100", str(out), str(out))
    assert same.returncode == 0 and "points.c=2.output_tok_s" in same.stdout


def test_an_unreachable_server_is_a_clear_error(tmp_path):
    run = bench("run", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path / "x.json"))
    assert run.returncode == 2 and "cannot list the models of http://127.0.0.1:9" in run.stderr


def test_a_poisson_rate_sweep_sends_every_request_on_its_schedule(stack: Stack, tmp_path):
    out = tmp_path / "rate.json"
    run = bench(
        "run",
        "--base-url",
        stack.base_url.removesuffix("/v1"),
        "--rate",
        "2,8",
        "--processes",
        "2",
        "--num-prompts",
        "4",
        "--input-words",
        "20",
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["workload"] == "rate" and [p["rate"] for p in result["points"]] == [2.0, 8.0]
    for point in result["points"]:
        assert (point["num_requests"], point["num_failed"], point["output_tokens"]) == (4, 0, 16)
    assert "rate=8:" in run.stdout and "[rate=8] 4/4 requests, 0 failed" in run.stderr  # the progress line
    for point in result["points"]:  # two generator processes, their send lag measured against the schedule
        generator = point["generator"]
        assert generator["processes"] == 2 and 0 <= generator["cpu_share"] < 1
        assert generator["send_lag_ms"]["p50"] >= 0 and isinstance(generator["bottleneck"], bool)


def test_a_trace_replay_sends_its_lines_with_shared_prefixes(stack: Stack, tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [(0, 32, [0, 1]), (300, 40, [0, 1, 2]), (600, 24, [0, 3]), (900, 10, [4])]
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": 3, "hash_ids": ids}) + "\n"
            for t, n, ids in lines
        )
    )
    out = tmp_path / "trace.json"
    run = bench(
        "run",
        "--base-url",
        stack.base_url.removesuffix("/v1"),
        "--trace",
        str(trace),
        "--block-size",
        "16",
        "--time-scale",
        "0.5",
        "--ignore-eos",
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    (point,) = result["points"]
    assert result["workload"] == "trace" and point["time_scale"] == 0.5
    assert (point["num_requests"], point["num_failed"], point["output_tokens"]) == (4, 0, 12)
    assert point["prompt_tokens"] >= 32 + 40 + 24 + 10 - 4  # about a token a word


def test_conversations_resend_their_history_and_the_cache_serves_it(stack: Stack, tmp_path):
    out = tmp_path / "talk.json"
    run = bench(
        "run",
        "--base-url",
        stack.base_url.removesuffix("/v1"),
        "--conversations",
        "2",
        "--turns",
        "3",
        "--input-words",
        "40",
        "--max-tokens",
        "4",
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.stderr
    (point,) = json.loads(out.read_text())["points"]
    assert point["conversations"] == 2 and (point["num_requests"], point["num_failed"]) == (6, 0)
    turns = point["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2] and all(t["num_requests"] == 2 for t in turns)
    assert turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < turns[2]["prompt_tokens"]
    assert turns[2]["cached_tokens"] > 0  # the history of turns 0 and 1 came from the prefix cache
