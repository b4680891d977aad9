"""KV planning on a GPU shared by two workers: each counts only its own memory against its share, and never
plans more than is free (the device calls are replaced: this runs on the CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer.engine import core as engine_core
from deepinfer.engine.args import EngineArgs
from deepinfer.engine.core import CUDA_CONTEXT_BYTES, EngineCore
from deepinfer.engine.execution import ExecutionMode
from deepinfer.models.config import ModelConfig

GiB = 1 << 30


def engine(utilization: float) -> EngineCore:
    """An EngineCore with only what `_device_kv_budget` reads (no model is loaded)."""
    config = SimpleNamespace(vocab_size=49152, head_dim=64, mla=None, num_attention_heads=32,
                             activation_bytes_per_token=lambda itemsize: 2048 * 8192 * itemsize // 1024)
    core = EngineCore.__new__(EngineCore)
    core.args = EngineArgs(gpu_memory_utilization=utilization, enforce_eager=True)
    core.execution_mode = ExecutionMode.EAGER
    core.model_config, core.dtype, core.device, core.max_model_len = config, torch.bfloat16, "cuda:0", 8192
    return core


def allocator(monkeypatch, allocated: int, cached: int = 0) -> None:
    """torch's caching allocator: `allocated` bytes in live tensors, `cached` more reserved but unused."""
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: allocated + cached)


@pytest.mark.parametrize("other_gib", [0, 45])
def test_a_second_worker_on_the_gpu_gets_its_own_share(monkeypatch, other_gib: int):
    total, own = 140 * GiB, 16 * GiB  # this worker: weights and graphs in torch's allocator
    free = total - own - CUDA_CONTEXT_BYTES - other_gib * GiB  # the other worker already took its share
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    allocator(monkeypatch, allocated=own)
    core = engine(0.45)
    budget = core._device_kv_budget()
    share = int(total * 0.45) - own - CUDA_CONTEXT_BYTES
    assert 0 < budget <= share and share - budget < 2 * GiB  # the share, less activation headroom
    assert budget <= free


def test_never_more_than_is_free(monkeypatch):
    total, own = 140 * GiB, 16 * GiB
    free = 10 * GiB  # someone else holds most of the device
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    allocator(monkeypatch, allocated=own)
    assert engine(0.9)._device_kv_budget() < free


def test_memory_an_earlier_engine_freed_is_available(monkeypatch):
    # An offline engine closed in this process leaves 60 GiB cached in torch's allocator, used by no tensor.
    total, own, cached = 140 * GiB, 16 * GiB, 60 * GiB
    free = total - own - cached - CUDA_CONTEXT_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    allocator(monkeypatch, allocated=own, cached=cached)
    budget = engine(0.45)._device_kv_budget()
    share = int(total * 0.45) - own - CUDA_CONTEXT_BYTES
    assert 0 < budget <= share and share - budget < 2 * GiB


def test_model_config_has_what_the_budget_reads():
    assert {"vocab_size", "head_dim", "mla", "num_attention_heads"} <= set(ModelConfig.__dataclass_fields__)
    assert callable(ModelConfig.activation_bytes_per_token)
    assert engine_core.CUDA_CONTEXT_BYTES == 512 << 20
