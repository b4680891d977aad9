"""deepinfer.bench.tier_stack (bench/kv/kv_tiers.py's stacks): the environment each mode's stack gets (which
tiers are on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.bench import tier_stack
from deepinfer.bench.tier_stack import StackPlan


def env_of(mode: str, host_tier: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setattr(tier_stack, "host_tier_available", lambda: host_tier)
    plan = StackPlan(mode, kv_cache_bytes=1 << 20, max_model_len=1024, host_cache_bytes=4 << 20,
                     store_bytes=8 << 20, load_timeout_s=60.0, extra_env=("DEEPINFER_DECODE_MAX_NUM_SEQS=8",))
    return plan.env(Path("/data"), random_weights=True)


@pytest.mark.parametrize(("mode", "store", "host"), [
    ("recompute", False, False), ("tiers-off", False, False), ("host", False, True), ("store", True, False),
    ("tiers-on", True, True), ("tiers-host", False, True),
])
def test_each_mode_turns_on_its_tiers_on_every_worker(mode: str, store: bool, host: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    env = env_of(mode, True, monkeypatch)
    for role in ("PREFILL", "DECODE"):
        assert env[f"DEEPINFER_{role}_KV_STORE"] == str(store).lower()
        assert env[f"DEEPINFER_{role}_KV_HOST_CACHE_BYTES"] == (str(4 << 20) if host else "0")
        assert env[f"DEEPINFER_{role}_KV_CACHE_BYTES"] == str(1 << 20)
        assert env[f"DEEPINFER_{role}_MAX_MODEL_LEN"] == "1024"
        assert env[f"DEEPINFER_{role}_LOAD_FORMAT"] == "dummy"
    assert (env.get("DEEPINFER_KVCACHE_RAM_BYTES") == str(8 << 20)) == store
    assert env["DEEPINFER_DATA_DIR"] == "/data" and env["DEEPINFER_DECODE_MAX_NUM_SEQS"] == "8"


def test_without_the_host_tier_its_setting_is_not_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    env = env_of("tiers-on", False, monkeypatch)
    assert not any("HOST_CACHE" in name for name in env)
    assert env["DEEPINFER_DECODE_KV_STORE"] == "true"


def test_store_shm_keeps_the_shards_ram_tier_in_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tier_stack, "host_tier_available", lambda: True)
    plan = StackPlan("store-shm", kv_cache_bytes=1 << 20, max_model_len=1024, host_cache_bytes=4 << 20,
                     store_bytes=8 << 20, load_timeout_s=60.0, load_choice="load", shm_slot_bytes=64 << 10)
    env = plan.env(Path("/data"), random_weights=True)
    assert env["DEEPINFER_KVCACHE_SHM_RAM"] == "true" and env["DEEPINFER_KVCACHE_SHM_SLOT_BYTES"] == str(64 << 10)
    assert int(env["DEEPINFER_KVCACHE_RAM_BYTES"]) <= 8 << 20  # capped by what /dev/shm has free
    for role in ("PREFILL", "DECODE"):
        assert env[f"DEEPINFER_{role}_KV_STORE"] == "true" and env[f"DEEPINFER_{role}_KV_LOAD_CHOICE"] == "load"
    assert env_of("store", True, monkeypatch)["DEEPINFER_DECODE_KV_LOAD_CHOICE"] == "measured"
    assert "DEEPINFER_KVCACHE_SHM_RAM" not in env_of("store", True, monkeypatch)
