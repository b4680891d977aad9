"""Settings: env names, defaults, validation (one line, exit 2), and the generated description."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from deepinfer import cli, subjects
from deepinfer.config import (
    ALL_SETTINGS,
    SERVICE_SETTINGS,
    CommonSettings,
    DecodeSettings,
    GatewaySettings,
    PrefillSettings,
    SchedulerSettings,
    describe_settings,
    env_name,
    load_settings,
    renamed,
    to_camel,
)
from deepinfer.config.describe import setting_fields


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("DEEPINFER_"):
            monkeypatch.delenv(key)


def test_env_names_follow_the_prefixes(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NATS_URL", "nats://nats:4222")
    monkeypatch.setenv("DEEPINFER_DECODE_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("DEEPINFER_PREFILL_MAX_NUM_SEQS", "99")  # another service's: must not leak
    monkeypatch.setenv("DEEPINFER_DECODE_NATS_URL", "nats://wrong:1")  # common fields only under DEEPINFER_
    decode = load_settings(DecodeSettings)
    assert decode.common.nats_url == "nats://nats:4222"
    assert decode.max_num_seqs == 8
    assert env_name(DecodeSettings, "max_num_seqs") == "DEEPINFER_DECODE_MAX_NUM_SEQS"
    assert env_name(CommonSettings, "nats_url") == "DEEPINFER_NATS_URL"


def test_defaults():
    gateway, scheduler, prefill = GatewaySettings(), SchedulerSettings(), PrefillSettings()
    assert (gateway.host, gateway.port, gateway.api_keys) == ("127.0.0.1", 8000, [])
    assert scheduler.worker_lease_s == 3.0
    assert (prefill.block_size, prefill.max_num_seqs, prefill.max_num_batched_tokens) == (16, 256, 2048)
    assert (prefill.gpu_memory_utilization, prefill.enable_prefix_caching) == (0.9, True)
    common = CommonSettings()
    assert (common.model, common.log_prompts, common.otel_exporter) == ("smollm2-135m-instruct", False, "none")


def test_default_ports_are_distinct():
    ports = [GatewaySettings().port]
    for cls in SERVICE_SETTINGS.values():
        settings = cls()
        ports.append(settings.internal_port)
        if hasattr(settings, "data_plane_port"):
            ports.append(settings.data_plane_port)
    assert len(ports) == len(set(ports)) and 0 not in ports


def test_default_ids_are_subject_safe_and_per_role():
    ids = [GatewaySettings().gateway_id, SchedulerSettings().scheduler_id]
    ids += [PrefillSettings().worker_id, DecodeSettings().worker_id]
    assert all(subjects.is_safe_id(i) for i in ids)
    assert len(set(ids)) == 4
    assert str(os.getpid()) in ids[0]


@pytest.mark.parametrize(
    ("env", "value", "cls"),
    [
        ("DEEPINFER_GATEWAY_PORT", "abc", GatewaySettings),
        ("DEEPINFER_GATEWAY_PORT", "70000", GatewaySettings),
        ("DEEPINFER_PREFILL_BLOCK_SIZE", "24", PrefillSettings),
        ("DEEPINFER_DECODE_GPU_MEMORY_UTILIZATION", "1.5", DecodeSettings),
        ("DEEPINFER_DECODE_GPU_MEMORY_UTILIZATION", "0", DecodeSettings),
        ("DEEPINFER_DECODE_WORKER_ID", "decode.1", DecodeSettings),
        ("DEEPINFER_LOG_LEVEL", "loud", SchedulerSettings),
        ("DEEPINFER_SERVED_MODEL_NAME", "kvcache", SchedulerSettings),
    ],
)
def test_bad_value_exits_2_with_one_line(monkeypatch, capsys, env: str, value: str, cls):
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as info:
        load_settings(cls)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"deepinfer: invalid setting {env}={value!r}: ")


def test_secret_values_never_printed(monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_NATS_TOKEN", "s3cret-token")
    monkeypatch.setenv("DEEPINFER_GATEWAY_API_KEYS", "key-one,key-two")
    gateway = load_settings(GatewaySettings)
    assert gateway.api_keys == ["key-one", "key-two"]
    assert gateway.common.nats_token.get_secret_value() == "s3cret-token"
    text = repr(gateway) + str([r.to_dict() for r in describe_settings([gateway])])
    assert "s3cret-token" not in text and "key-one" not in text


def test_api_keys_json_list(monkeypatch):
    monkeypatch.setenv("DEEPINFER_GATEWAY_API_KEYS", '["a,b", "c"]')
    assert load_settings(GatewaySettings).api_keys == ["a,b", "c"]


def test_sizes_and_paths(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("DEEPINFER_DECODE_KV_CACHE_BYTES", "1GiB")
    monkeypatch.setenv("DEEPINFER_DATA_DIR", str(tmp_path))
    decode = load_settings(DecodeSettings)
    assert decode.kv_cache_bytes == 2**30
    assert decode.common.data_dir == tmp_path


def test_xdg_dirs(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    common = CommonSettings()
    assert common.model_cache_dir == tmp_path / "c" / "deepinfer" / "models"
    assert common.data_dir == tmp_path / "d" / "deepinfer"


@pytest.mark.parametrize(
    ("model", "served"),
    [("smollm2-135m-instruct", "smollm2-135m-instruct"), ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B"), ("/m/Foo.Bar", "Foo.Bar")],
)
def test_served_model_name_is_derived(monkeypatch, model: str, served: str):
    monkeypatch.setenv("DEEPINFER_MODEL", model)
    common = load_settings(CommonSettings)
    assert common.served_model_name == served
    assert common.model_token == subjects.model_token(served)


def test_explicit_served_model_name_wins(monkeypatch):
    monkeypatch.setenv("DEEPINFER_MODEL", "/m/x")
    monkeypatch.setenv("DEEPINFER_SERVED_MODEL_NAME", "chat")
    assert load_settings(CommonSettings).served_model_name == "chat"


def test_settings_are_frozen():
    with pytest.raises(ValidationError):
        GatewaySettings().port = 1  # type: ignore[misc]


def test_empty_env_value_means_unset(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PREFILL_MAX_MODEL_LEN", "")
    assert load_settings(PrefillSettings).max_model_len is None


def test_describe_covers_every_field_once():
    rows = describe_settings()
    expected = {env_name(cls, name) for cls in ALL_SETTINGS for name in setting_fields(cls)}
    assert {r.env for r in rows} == expected
    assert len(rows) == len(expected)
    assert all(r.description for r in rows)
    assert "DEEPINFER_GATEWAY_COMMON" not in expected


def test_describe_defaults_and_secrets():
    rows = {r.env: r for r in describe_settings()}
    assert rows["DEEPINFER_GATEWAY_PORT"].default == "8000"
    assert rows["DEEPINFER_NATS_TOKEN"].secret and rows["DEEPINFER_NATS_TOKEN"].default == "unset"
    assert rows["DEEPINFER_GATEWAY_API_KEYS"].secret
    assert rows["DEEPINFER_GATEWAY_MAX_REQUEST_BYTES"].default == "16.0MiB"
    assert rows["DEEPINFER_ACCELERATOR"].type == "auto|cuda|ascend|cpu"
    assert rows["DEEPINFER_PREFILL_MAX_MODEL_LEN"].type == "int | None"
    assert rows["DEEPINFER_DECODE_GPU_MEMORY_UTILIZATION"].helm_key == "gpuMemoryUtilization"


@pytest.mark.parametrize(
    ("name", "camel"),
    [("port", "port"), ("gpu_memory_utilization", "gpuMemoryUtilization"), ("ttl_s", "ttlS"), ("nats_tls_ca", "natsTlsCa")],
)
def test_to_camel(name: str, camel: str):
    assert to_camel(name) == camel


# -- renamed settings: the old env name for one release ------------------------------------------------------------
@pytest.fixture
def max_seqs_renamed(monkeypatch):
    """A rename max_seqs -> max_num_seqs (a worker field) and nats_address -> nats_url (a common one)."""
    monkeypatch.setitem(renamed.RENAMED, "max_seqs", "max_num_seqs")
    monkeypatch.setitem(renamed.RENAMED, "nats_address", "nats_url")


def test_an_old_env_name_sets_the_renamed_field_with_a_warning(monkeypatch, caplog, max_seqs_renamed):
    monkeypatch.setenv("DEEPINFER_DECODE_MAX_SEQS", "8")
    monkeypatch.setenv("DEEPINFER_NATS_ADDRESS", "nats://old:4222")
    with caplog.at_level(logging.WARNING, logger=renamed.__name__):
        decode = load_settings(DecodeSettings)
        prefill = load_settings(PrefillSettings)
    assert (decode.max_num_seqs, prefill.max_num_seqs) == (8, 256)  # each service reads its own prefix
    assert decode.common.nats_url == prefill.common.nats_url == "nats://old:4222"
    assert "DEEPINFER_DECODE_MAX_SEQS is deprecated: use DEEPINFER_DECODE_MAX_NUM_SEQS" in caplog.text
    assert "DEEPINFER_NATS_ADDRESS is deprecated: use DEEPINFER_NATS_URL" in caplog.text


def test_the_new_env_name_wins_over_the_old(monkeypatch, caplog, max_seqs_renamed):
    monkeypatch.setenv("DEEPINFER_DECODE_MAX_SEQS", "8")
    monkeypatch.setenv("DEEPINFER_DECODE_MAX_NUM_SEQS", "16")
    with caplog.at_level(logging.WARNING, logger=renamed.__name__):
        assert load_settings(DecodeSettings).max_num_seqs == 16
    assert "DEEPINFER_DECODE_MAX_SEQS is deprecated and ignored: DEEPINFER_DECODE_MAX_NUM_SEQS is set" in caplog.text
    assert DecodeSettings(max_num_seqs=4).max_num_seqs == 4  # init arguments before both


def test_a_bad_value_under_an_old_name_exits_2(monkeypatch, capsys, max_seqs_renamed):
    monkeypatch.setenv("DEEPINFER_DECODE_MAX_SEQS", "many")
    with pytest.raises(SystemExit) as info:
        load_settings(DecodeSettings)
    assert info.value.code == 2
    assert "invalid setting DEEPINFER_DECODE_MAX_NUM_SEQS='many'" in capsys.readouterr().err


def test_deepinfer_config_lists_only_new_names_and_knows_the_old(monkeypatch, capsys, max_seqs_renamed):
    monkeypatch.setenv("DEEPINFER_DECODE_MAX_SEQS", "8")
    assert cli.main(["config", "--json"]) == 0
    out, err = capsys.readouterr()
    rows = {row["env"]: row for row in json.loads(out)}
    assert rows["DEEPINFER_DECODE_MAX_NUM_SEQS"]["value"] == "8"
    assert not [env for env in rows if "MAX_SEQS" in env or "NATS_ADDRESS" in env]
    assert "unknown setting" not in err


def test_every_rename_names_a_field_and_retires_the_old_name():
    fields = {name for cls in ALL_SETTINGS for name in setting_fields(cls)}
    for old, new in renamed.RENAMED.items():
        assert new in fields and old not in fields, (old, new)
    for old, (beside, _) in renamed.REMOVED.items():
        assert beside in fields and old not in fields, (old, beside)


def test_a_removed_settings_env_name_is_reported_as_having_no_effect(monkeypatch, caplog, capsys):
    monkeypatch.setenv("DEEPINFER_SCHEDULER_STORE_HIT_WEIGHT", "0.5")
    with caplog.at_level(logging.WARNING, logger=renamed.__name__):
        settings = load_settings(SchedulerSettings)
    assert not hasattr(settings, "store_hit_weight")
    assert "DEEPINFER_SCHEDULER_STORE_HIT_WEIGHT=0.5 is deprecated and has no effect: the router credits" in caplog.text
    assert cli.main(["config", "--json"]) == 0
    assert "unknown setting" not in capsys.readouterr().err


# -- one default per setting: the settings and the code they configure agree -----------------------------------------
def _default(cls: type, name: str) -> object:
    if dataclasses.is_dataclass(cls):
        field = {f.name: f for f in dataclasses.fields(cls)}[name]
        return field.default
    return cls.model_fields[name].get_default(call_default_factory=True)


def test_engine_args_and_worker_settings_share_every_default():
    pytest.importorskip("torch")
    from deepinfer.engine.args import EngineArgs

    shared = {f.name for f in dataclasses.fields(EngineArgs)} & set(setting_fields(DecodeSettings))
    assert {"block_size", "max_num_seqs", "gpu_memory_utilization", "eager_step_switch_interval_s"} <= shared
    for name in sorted(shared):
        assert _default(EngineArgs, name) == _default(DecodeSettings, name), name
    assert _default(EngineArgs, "accelerator") == _default(CommonSettings, "accelerator")


def test_the_router_and_the_store_read_their_settings_defaults():
    from deepinfer.config import KvCacheSettings
    from deepinfer.kvcache.store import StoreSettings
    from services.scheduler.kv_index import KvIndex
    from services.scheduler.prefix_policy import CostWeights

    for field in dataclasses.fields(CostWeights):
        assert field.default == _default(SchedulerSettings, field.name), field.name
    assert KvIndex().max_entries == _default(SchedulerSettings, "kv_index_max_entries")
    for name in ("ram_bytes", "disk_bytes", "ttl_s", "fsync"):
        assert _default(StoreSettings, name) == _default(KvCacheSettings, name), name
    assert _default(GatewaySettings, "worker_lease_s") == _default(SchedulerSettings, "worker_lease_s")


@pytest.mark.parametrize(("env", "mode"), [
    ({"DEEPINFER_DECODE_PIECEWISE_CUDA_GRAPHS": "false"}, "decode"),
    ({"DEEPINFER_DECODE_FULL_CUDA_GRAPHS": "false"}, "piecewise"),
    ({"DEEPINFER_DECODE_PIECEWISE_CUDA_GRAPHS": "false", "DEEPINFER_DECODE_FULL_CUDA_GRAPHS": "false"}, "decode"),
    ({"DEEPINFER_DECODE_FULL_CUDA_GRAPHS": "true"}, "full"),
    ({"DEEPINFER_DECODE_FULL_CUDA_GRAPHS": "false", "DEEPINFER_DECODE_EXECUTION_MODE": "eager"}, "eager"),
])
def test_the_old_graph_switches_set_the_execution_mode_with_a_warning(monkeypatch, caplog, env, mode):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DEEPINFER_DECODE_FULL_GRAPH_SAMPLING", "true")  # now part of graph_sampling (on)
    with caplog.at_level(logging.WARNING, logger=renamed.__name__):
        settings = load_settings(DecodeSettings)
    assert (settings.execution_mode, settings.graph_sampling) == (mode, True)
    assert load_settings(PrefillSettings).execution_mode == "full"  # each service reads its own prefix
    for name in env:
        if name != "DEEPINFER_DECODE_EXECUTION_MODE":
            assert f"{name}={env[name]} is deprecated" in caplog.text
    assert "DEEPINFER_DECODE_FULL_GRAPH_SAMPLING=true is deprecated and has no effect" in caplog.text


def test_a_cpu_worker_bounds_its_prompt_steps_by_time_and_the_offline_engine_does_not():
    pytest.importorskip("torch")
    from deepinfer.engine import EngineArgs
    from deepinfer.worker.settings import engine_args

    assert engine_args(DecodeSettings(device="cpu")).resolve_prefill_chunk_s() == 0.5  # an abort waits ~0.5 s
    assert engine_args(DecodeSettings(device="cpu", prefill_chunk_s=0)).resolve_prefill_chunk_s() is None
    assert engine_args(DecodeSettings(device="cpu", prefill_chunk_s=2)).resolve_prefill_chunk_s() == 2
    assert EngineArgs().resolve_prefill_chunk_s() is None  # LLM: steps that do not depend on the machine's speed


def test_the_decode_worker_speculates_from_one_json_setting(monkeypatch):
    pytest.importorskip("torch")
    from deepinfer.engine import SpeculativeConfig
    from deepinfer.worker.settings import engine_args

    monkeypatch.setenv("DEEPINFER_DECODE_SPECULATIVE_CONFIG",
                       '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    args = engine_args(load_settings(DecodeSettings))
    assert args.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                        prompt_lookup_min=4, prompt_lookup_max=4)
    suffix = engine_args(DecodeSettings(speculative_config='{"method": "suffix", "suffix_decoding_max_tree_depth": 16}'))
    assert suffix.speculative_config == SpeculativeConfig(method="suffix", num_speculative_tokens=16,
                                                          suffix_decoding_max_tree_depth=16)
    draft = engine_args(DecodeSettings(
        speculative_config='{"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": "auto"}'))
    assert draft.speculative_config == SpeculativeConfig(method="draft_model", model="/models/draft",
                                                         num_speculative_tokens="auto")
    monkeypatch.delenv("DEEPINFER_DECODE_SPECULATIVE_CONFIG")
    assert engine_args(DecodeSettings()).speculative_config is None
    assert engine_args(PrefillSettings()).speculative_config is None  # one token per request: nothing to draft
    for bad in ("ngram", "[1]"):
        with pytest.raises(ValidationError, match="speculative_config"):
            DecodeSettings(speculative_config=bad)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1"):
        engine_args(DecodeSettings(speculative_config='{"method": "ngram", "num_speculative_tokens": 0}'))
