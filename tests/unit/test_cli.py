"""`deepinfer config` in a real subprocess: every setting listed, bad env -> exit 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepinfer.cli import SUBCOMMANDS, build_parser
from deepinfer.config import ALL_SETTINGS, env_name
from deepinfer.config.describe import setting_fields


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def all_env_names() -> set[str]:
    return {env_name(cls, name) for cls in ALL_SETTINGS for name in setting_fields(cls)}


def test_config_table_lists_every_setting():
    result = run_cli("config")
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines()[1:]}
    assert listed == all_env_names()


def test_config_json_with_current_values_and_masked_secrets():
    result = run_cli("config", "--json", DEEPINFER_GATEWAY_PORT="9000", DEEPINFER_NATS_TOKEN="tok-123")
    assert result.returncode == 0, result.stderr
    rows = {row["env"]: row for row in json.loads(result.stdout)}
    assert set(rows) == all_env_names()
    assert rows["DEEPINFER_GATEWAY_PORT"]["default"] == "8000"
    assert rows["DEEPINFER_GATEWAY_PORT"]["value"] == "9000"
    assert rows["DEEPINFER_NATS_TOKEN"]["value"] == "***"
    assert "tok-123" not in result.stdout


def test_unknown_setting_is_warned_about():
    result = run_cli("config", "--json", DEEPINFER_GATEWAY_PROT="9000")
    assert result.returncode == 0
    assert result.stderr.splitlines() == ["deepinfer: warning: unknown setting DEEPINFER_GATEWAY_PROT is ignored"]


def test_a_renamed_settings_old_env_name_still_sets_it_with_a_warning():
    old, new = "DEEPINFER_DECODE_GIL_SWITCH_INTERVAL_EAGER_STEP_S", "DEEPINFER_DECODE_EAGER_STEP_SWITCH_INTERVAL_S"
    result = run_cli("config", "--json", **{old: "5e-05"})
    assert result.returncode == 0, result.stderr
    rows = {row["env"]: row for row in json.loads(result.stdout)}
    assert rows[new]["value"] == "5e-05" and old not in rows
    assert result.stderr.splitlines() == [f"{old} is deprecated: use {new} (the old name goes in the next release)"]


def test_config_service_filter():
    result = run_cli("config", "--json", "--service", "scheduler")
    assert {row["group"] for row in json.loads(result.stdout)} == {"scheduler"}


@pytest.mark.parametrize(
    ("env", "value"), [("DEEPINFER_GATEWAY_PORT", "abc"), ("DEEPINFER_LOG_FORMAT", "xml")]
)
def test_bad_env_exits_2_with_one_line(env: str, value: str):
    result = run_cli("config", **{env: value})
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and env in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_help_and_registry():
    result = run_cli("--help")
    assert result.returncode == 0
    for name in SUBCOMMANDS:
        assert name in result.stdout
    assert build_parser().parse_args(["config", "--json"]).json is True


def test_no_command_prints_help_and_fails():
    result = run_cli()
    assert result.returncode == 2 and "usage: deepinfer" in result.stdout


def test_up_port_check_ignores_time_wait_but_not_a_listener():
    import socket

    from deepinfer.up.cli import _port_free

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    assert not _port_free("127.0.0.1", port)  # a live listener: in use
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the side that closes first keeps the port in TIME-WAIT
    client.close()
    listener.close()
    assert _port_free("127.0.0.1", port)  # only TIME-WAIT left: the gateway (SO_REUSEADDR) can bind it


def test_up_passes_a_checked_speculative_config_to_the_decode_workers():
    from deepinfer.up.cli import _worker_env

    parser = build_parser()
    config = '{"method": "ngram", "num_speculative_tokens": 4}'
    args = parser.parse_args(["up", "--speculative-config", config])
    assert _worker_env(args) == {"DEEPINFER_DECODE_SPECULATIVE_CONFIG": config}
    assert _worker_env(parser.parse_args(["up"])) == {}
    result = run_cli("up", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}')
    assert result.returncode == 2 and "num_speculative_tokens must be an int >= 1" in result.stderr


def test_up_makes_a_relative_draft_model_path_absolute_as_the_target_s(tmp_path, monkeypatch):
    from deepinfer.up.cli import _worker_env

    (tmp_path / "draft").mkdir()
    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    for model, want in (("draft", str(tmp_path / "draft")), ("smollm2-135m", "smollm2-135m")):
        config = json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": "auto"})
        env = _worker_env(parser.parse_args(["up", "--speculative-config", config]))
        assert json.loads(env["DEEPINFER_DECODE_SPECULATIVE_CONFIG"]) == {
            "method": "draft_model", "model": want, "num_speculative_tokens": "auto"}


def test_up_turns_on_kv_by_layer_type_on_the_decode_workers_with_no_prefill_worker():
    from deepinfer.up.cli import _worker_env, num_prefill

    parser = build_parser()
    args = parser.parse_args(["up", "--enable-hybrid-kv-cache"])
    assert _worker_env(args) == {"DEEPINFER_DECODE_ENABLE_HYBRID_KV_CACHE": "true"} and num_prefill(args) == 0
    assert num_prefill(parser.parse_args(["up", "--enable-hybrid-kv-cache", "--prefill", "2"])) == 2
    assert num_prefill(parser.parse_args(["up"])) is None


def test_bench_run_up_takes_up_s_stack_flags_and_refuses_a_port_in_use(tmp_path):
    import socket

    args = build_parser().parse_args(["bench", "run", "--up", "--device", "cpu", "--prefill", "0"])
    assert (args.up, args.device, args.prefill, args.port, args.model) == (True, "cpu", 0, 0, None)  # any free port
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_cli("bench", "run", "--up", "--port", str(port), "--out", str(tmp_path / "x.json"),
                         DEEPINFER_DATA_DIR=str(tmp_path / "data"))
    assert result.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "x.json").exists()  # nothing was started


def test_bench_run_makes_the_folders_of_its_outputs_and_fails_when_no_request_is_served(tmp_path):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as closed:  # a port nothing listens on once this block ends
        port = closed.getsockname()[1]
    out = tmp_path / "new" / "run.json"
    result = run_cli("bench", "run", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--concurrency", "1",
                     "--num-prompts", "1", "--max-tokens", "2", "--no-plots", "--out", str(out),
                     "--csv", str(tmp_path / "csv" / "run.csv"))
    assert result.returncode == 1 and "first error" in result.stderr  # every request failed: not a success
    assert out.exists() and (tmp_path / "csv" / "run.csv").exists()  # written, though their folders did not exist
