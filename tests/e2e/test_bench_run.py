"""`deepinfer bench run` against the stack, one short run per workload (a concurrency sweep, a Poisson rate sweep
over two generator processes, a Mooncake trace, conversations): the JSON follows its schema, the CSV has one row
per point, every request completed with the tokens the server reported, the cost table is printed, the PNGs are
valid (where matplotlib is installed), and `bench compare` reads two runs and draws them on one plot. `--up`
starts a stack of its own for the run and stops it after."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from deepinfer.up import Stack

pytestmark = pytest.mark.e2e


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "deepinfer.cli", "bench", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def bench_run(stack: Stack, flags: str, out, *more: str) -> dict:
    """`bench run` against the stack with `flags` (split on spaces); the JSON it wrote."""
    run = bench(
        "run", "--base-url", stack.base_url.removesuffix("/v1"), *flags.split(), "--out", str(out), *more
    )
    assert run.returncode == 0, run.stderr
    return {"result": json.loads(out.read_text()), "stdout": run.stdout, "stderr": run.stderr}


def test_a_short_sweep_writes_json_and_csv_that_compare_reads(stack: Stack, tmp_path):
    out, table = tmp_path / "run.json", tmp_path / "run.csv"
    flags = "--concurrency 1,2 --num-prompts 4 --input-words 40 --max-tokens 8 --ignore-eos --gpus 2 --gpu-hour-usd 2.5"
    run = bench_run(stack, flags, out, "--csv", str(table))
    result = run["result"]
    assert (result["bench"], result["schema"], result["model"]) == (
        "deepinfer-bench-run",
        2,
        stack.model_name,
    )
    assert result["workload"] == "concurrency" and [p["concurrency"] for p in result["points"]] == [1, 2]
    for point in result["points"]:
        assert (point["num_requests"], point["num_failed"], point["output_tokens"]) == (
            4,
            0,
            32,
        )  # ignore_eos
        assert point["prompt_tokens"] > 4 * 40 // 2 and point["output_tok_s"] > 0
        assert 0 < point["ttft_ms"]["p50"] <= point["e2e_ms"]["p50"] and point["itl_ms"]["p50"] > 0
        assert point["output_tok_s_per_gpu"] == pytest.approx(point["output_tok_s"] / 2, abs=1e-3)
        assert point["cost"]["cost_usd"] == pytest.approx(2 * 2.5 * point["wall_s"] / 3600, rel=1e-3)
        assert 0 < point["cost"]["usd_per_m_input_uncached"] < point["cost"]["usd_per_m_output"]
        assert point["generator"]["processes"] == 1 and "send_lag_ms" not in point["generator"]  # closed loop
    assert "$ per million tokens" in run["stdout"] and "c=2" in run["stdout"]
    rows = list(csv.DictReader(table.open()))
    assert [row["concurrency"] for row in rows] == ["1", "2"] and "ttft_ms_p99" in rows[0]
    assert "cost_usd_per_m_output" in rows[0]
    plots = [tmp_path / f"{name}.png" for name in ("run-pareto", "run-cdf", "run-throughput")]
    assert len(result["points"][1]["cdf_ms"]["ttft"]) == 101 and result["points"][1]["cdf_ms"]["itl"]
    same = bench("compare", "--tolerance", "100", str(out), str(out), "--plots", str(tmp_path / "both"))
    assert (
        same.returncode == 0
        and "points.c=2.output_tok_s" in same.stdout
        and "points.c=2.ttft_ms.p99" in same.stdout
    )
    if importlib.util.find_spec("matplotlib") is None:  # the PNGs are the optional `deepinfer[bench]` extra
        assert "no plots: matplotlib is not installed" in run["stderr"] and not any(p.exists() for p in plots)
        return
    plots += [tmp_path / f"{name}.png" for name in ("both-pareto", "both-cdf", "both-throughput")]
    for path in plots:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


def test_an_unreachable_server_is_a_clear_error(tmp_path):
    run = bench("run", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path / "x.json"))
    assert run.returncode == 2 and "cannot list the models of http://127.0.0.1:9" in run.stderr


def test_a_poisson_rate_sweep_over_two_processes_reports_its_send_lag(stack: Stack, tmp_path):
    flags = "--rate 2,8 --processes 2 --num-prompts 4 --input-words 20 --max-tokens 4 --ignore-eos"
    run = bench_run(stack, flags, tmp_path / "rate.json")
    result = run["result"]
    assert result["workload"] == "rate" and [p["rate"] for p in result["points"]] == [2.0, 8.0]
    for point in result["points"]:
        assert (point["num_requests"], point["num_failed"], point["output_tokens"]) == (4, 0, 16)
        generator = point["generator"]  # two processes, their send lag measured against the schedule
        assert generator["processes"] == 2 and 0 <= generator["cpu_share"] < 1
        assert generator["send_lag_ms"]["p50"] >= 0 and isinstance(generator["bottleneck"], bool)
    assert (
        "rate=8:" in run["stdout"] and "[rate=8] 4/4 requests, 0 failed" in run["stderr"]
    )  # the progress line


def test_a_trace_replay_sends_its_lines_with_shared_prefixes(stack: Stack, tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [(0, 32, [0, 1]), (300, 40, [0, 1, 2]), (600, 24, [0, 3]), (900, 10, [4])]
    with trace.open("w") as f:
        for t, n, ids in lines:
            f.write(
                json.dumps({"timestamp": t, "input_length": n, "output_length": 3, "hash_ids": ids}) + "\n"
            )
    flags = f"--trace {trace} --block-size 16 --time-scale 0.5 --ignore-eos"
    result = bench_run(stack, flags, tmp_path / "trace.json")["result"]
    (point,) = result["points"]
    assert result["workload"] == "trace" and point["time_scale"] == 0.5
    assert (point["num_requests"], point["num_failed"], point["output_tokens"]) == (4, 0, 12)
    assert point["prompt_tokens"] >= 32 + 40 + 24 + 10 - 4  # about a token a word
    assert point["generator"]["send_lag_ms"]["p50"] >= 0


def test_conversations_resend_their_history_and_the_cache_serves_it(stack: Stack, tmp_path):
    flags = "--conversations 2 --turns 3 --input-words 40 --max-tokens 4"
    (point,) = bench_run(stack, flags, tmp_path / "talk.json")["result"]["points"]
    assert point["conversations"] == 2 and (point["num_requests"], point["num_failed"]) == (6, 0)
    turns = point["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2] and all(t["num_requests"] == 2 for t in turns)
    assert turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < turns[2]["prompt_tokens"]
    assert turns[2]["cached_tokens"] > 0  # the history of turns 0 and 1 came from the prefix cache


def test_up_starts_a_stack_for_the_run_and_stops_it(tmp_path):
    env = {**os.environ, "DEEPINFER_DATA_DIR": str(tmp_path / "data"), "DEEPINFER_GATEWAY_API_KEYS": "",
           "OMP_NUM_THREADS": "1"}
    stack = "--device cpu --prefill 0 --schedulers 1 --gateways 1 --kvcache 0"
    flags = "--concurrency 2 --num-prompts 2 --input-words 20 --max-tokens 4 --ignore-eos --no-plots"
    out = tmp_path / "up.json"
    run = bench("run", "--up", *stack.split(), *flags.split(), "--out", str(out), env=env)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["model"] == "smollm2-135m-instruct" and result["base_url"].startswith("http://127.0.0.1:")
    (point,) = result["points"]
    assert (point["num_requests"], point["num_failed"], point["output_tokens"]) == (2, 0, 8)
    gateway_log = (tmp_path / "data" / "up" / "logs" / "gateway-0.log").read_text()
    assert gateway_log.count("gateway stopped") == 1 and "stopped" in run.stderr.splitlines()[-1]
