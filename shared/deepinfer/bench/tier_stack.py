"""The stacks bench/kv/kv_tiers.py runs: one per mode, the KV tiers set through the workers' environment, and
what it reads back from them (the device pool's size, write-behind progress) on their /metrics.

Modes: which tiers are on.

    recompute / tiers-off   host tier off, store off (no kvcache shard)
    host                    host tier on, store off
    store                   host tier off, one kvcache shard, store on (gets over the data plane)
    store-shm               as store, the shard's RAM tier in shared memory (DEEPINFER_KVCACHE_SHM_RAM): gets
                            through it, on CUDA slots DMA'd straight to the device (kv_store_shm_dma)
    tiers-on                host tier on (where it exists), one kvcache shard, store on
    tiers-host              host tier on, store off (against tiers-on: what the store adds beside the host tier)

`load_choice` is every worker's kv_load_choice: "measured" (load or recompute at the measured rates) or "load"
(always load what a tier holds: the load path measured whatever the chooser would say).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from deepinfer.config import DecodeSettings, KvCacheSettings, PrefillSettings, WorkerSettings, env_name

#: The worker setting of the host tier (bytes of host memory; 0 = off), in main once the host tier is.
HOST_FIELD = "kv_host_cache_bytes"
STORE_MODES, HOST_MODES, SHM_MODES = ("store", "store-shm", "tiers-on"), ("host", "tiers-on", "tiers-host"), ("store-shm",)
_SAMPLE = re.compile(r"^(\w+)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$")


def host_tier_available() -> bool:
    """Whether this installation's workers have the host-memory tier setting."""
    return HOST_FIELD in WorkerSettings.model_fields


@dataclass(frozen=True)
class Model:
    """What the bench needs to know of the served model before a stack starts."""

    name: str  # what Stack(model=...) gets
    bytes_per_token: int  # KV bytes of one token over all layers, in the workers' dtype
    block_size: int
    count_tokens: Callable[[str], int]
    max_position_embeddings: int


def load_model(model: str, device: str) -> Model:
    """The served model's KV cost per token (in the workers' "auto" dtype: EngineArgs.resolve_dtype) and a
    tokenizer to size prompts with."""
    import tokenizers
    import torch

    from deepinfer.config import CommonSettings
    from deepinfer.defaults import DEFAULT_BLOCK_SIZE
    from deepinfer.engine import EngineArgs
    from deepinfer.model_store import resolve_model
    from deepinfer.models.config import ModelConfig

    directory = resolve_model(model, CommonSettings().model_cache_dir, progress=False)
    hf = json.loads((directory / "config.json").read_text())
    config = ModelConfig.from_hf_config(hf)
    dtype = EngineArgs().resolve_dtype(torch.device(device))
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    return Model(model, config.kv_bytes_per_token(dtype), DEFAULT_BLOCK_SIZE,
                 lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids),
                 config.max_position_embeddings)


@dataclass(frozen=True)
class StackPlan:
    """The settings of one mode's stack."""

    mode: str
    kv_cache_bytes: int
    max_model_len: int
    host_cache_bytes: int
    store_bytes: int  # the shard's RAM and disk capacity
    load_timeout_s: float
    extra_env: tuple[str, ...] = ()  # NAME=VALUE, last
    load_choice: str = "measured"  # the workers' kv_load_choice
    shm_slot_bytes: int = 2 << 20  # a block's bytes, page-rounded (store-shm: one block a slot)

    @property
    def store(self) -> bool:
        return self.mode in STORE_MODES

    @property
    def host(self) -> bool:
        return self.mode in HOST_MODES and host_tier_available()

    def env(self, data_dir: Path, random_weights: bool) -> dict[str, str]:
        """Every service's environment overrides."""
        worker = {"kv_cache_bytes": self.kv_cache_bytes, "max_model_len": self.max_model_len,
                  "kv_store": str(self.store).lower(), "kv_store_load_timeout_s": self.load_timeout_s,
                  "kv_load_choice": self.load_choice}
        if host_tier_available():
            worker[HOST_FIELD] = self.host_cache_bytes if self.host else 0
        if random_weights:
            worker["load_format"] = "dummy"
        env = {"DEEPINFER_GATEWAY_API_KEYS": "", "DEEPINFER_DATA_DIR": str(data_dir)}
        for cls in (PrefillSettings, DecodeSettings):  # the same tiers whichever worker computes the prompt
            env |= {env_name(cls, key): str(value) for key, value in worker.items()}
        if self.store:
            env |= {env_name(KvCacheSettings, "ram_bytes"): str(self.store_bytes),
                    env_name(KvCacheSettings, "disk_bytes"): str(self.store_bytes)}
        if self.mode in SHM_MODES:
            env |= {env_name(KvCacheSettings, "shm_ram"): "true",
                    env_name(KvCacheSettings, "ram_bytes"): str(shm_ram_bytes(self.store_bytes)),
                    env_name(KvCacheSettings, "shm_slot_bytes"): str(self.shm_slot_bytes)}
        return env | dict(item.split("=", 1) for item in self.extra_env)


def shm_ram_bytes(store_bytes: int, shm_dir: str = "/dev/shm") -> int:
    """The shared-memory RAM tier: the store's bytes, or 90% of what the tmpfs has free when that is less (a
    container's /dev/shm may be small; blocks past it are on disk only and are read from there, slower)."""
    with contextlib.suppress(OSError):
        free = int(0.9 * shutil.disk_usage(shm_dir).free)
        if free < store_bytes:
            print(f"WARNING: {shm_dir} has {free / 2**30:.1f} GiB free for a {store_bytes / 2**30:.1f} GiB "
                  "shared-memory RAM tier: capped, loads past it come from disk", file=sys.stderr, flush=True)
            return free
    return store_bytes


def start_stack(plan: StackPlan, model: str, device: str, num_prefill: int, random_weights: bool):
    """The whole stack for one mode on a fresh data dir, ready: (stack, data dir handle)."""
    from deepinfer.up import Stack

    data_dir = tempfile.TemporaryDirectory(prefix="kv-tiers-")  # under $TMPDIR
    free = shutil.disk_usage(data_dir.name).free
    if plan.store and free < plan.store_bytes:
        print(f"WARNING: {free / 2**30:.1f} GiB free under {data_dir.name}, the store may write "
              f"{plan.store_bytes / 2**30:.1f} GiB (set TMPDIR elsewhere)", file=sys.stderr, flush=True)
    stack = Stack(model=model, device=device, port=0, num_prefill=num_prefill, num_gateways=1,
                  num_kvcache=1 if plan.store else 0, env_overrides=plan.env(Path(data_dir.name), random_weights),
                  start_timeout_s=900)
    try:
        stack.start()
        stack.wait_ready()
    except BaseException:
        stack.stop()
        data_dir.cleanup()
        raise
    return stack, data_dir


def worker_ports(stack) -> dict[str, int]:
    """Internal ports of the stack's workers."""
    return {name: info.internal_port for name, info in stack.services.items()
            if info.service in ("prefill", "decode") and info.internal_port}


def metric_sums(ports: dict[str, int], names: tuple[str, ...]) -> dict[str, float]:
    """Each metric (by its full name, labels summed over) summed over the services at `ports`."""
    sums = dict.fromkeys(names, 0.0)
    for port in ports.values():
        for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
            match = _SAMPLE.match(line)
            if match and match.group(1) in sums:
                sums[match.group(1)] += float(match.group(2))
    return sums


def pool_blocks(stack) -> int:
    """Usable KV blocks (block 0, reserved, not counted) in the device pool of the worker that serves (the decode
    worker's, which computes prompts itself without a prefill worker)."""
    port = stack.services["decode-0"].internal_port
    return int(metric_sums({"decode-0": port}, ("deepinfer_worker_total_blocks",))["deepinfer_worker_total_blocks"])


WRITE_METRICS = ("deepinfer_worker_store_written_blocks_total", "deepinfer_worker_store_write_dropped_blocks_total",
                 "deepinfer_worker_store_write_queue_blocks")


class WriteBehind:
    """Write-behind progress of a stack's workers, counted from a mark."""

    def __init__(self, stack):
        self.ports = worker_ports(stack)
        self.mark()

    def read(self) -> tuple[float, float, float]:
        sums = metric_sums(self.ports, WRITE_METRICS)
        return tuple(sums[name] for name in WRITE_METRICS)

    def mark(self) -> None:
        """Count written and dropped blocks from now on."""
        self._base = self.read()[:2]

    def wait(self, expected_blocks: int, timeout_s: float, idle_s: float = 5.0, poll_s: float = 0.25) -> dict:
        """Until `expected_blocks` more were written or dropped and the queue is empty, or until nothing moved
        for `idle_s` with an empty queue (blocks the store held already are not written again); at most
        `timeout_s`. Marks again. {"written", "dropped", "expected", "complete", "waited_s"}: complete is False
        when the blocks did not all arrive in the store."""
        started = changed = time.monotonic()
        last = None
        while True:
            written, dropped, queued = self.read()
            counts = (written - self._base[0], dropped - self._base[1])
            now = time.monotonic()
            if counts != last or queued:
                last, changed = counts, now
            if queued == 0 and (sum(counts) >= expected_blocks or now - changed >= idle_s):
                break
            if now - started > timeout_s:
                break
            time.sleep(poll_s)
        self.mark()
        return {"written": int(counts[0]), "dropped": int(counts[1]), "expected": expected_blocks,
                "complete": counts[0] >= expected_blocks and queued == 0,
                "waited_s": round(time.monotonic() - started, 2)}
