"""Unit-tier fixtures shared by several modules."""

from __future__ import annotations

import time

import pytest

from deepinfer.model_store import resolve_model
from tests.cpu_dtype import float32_on_every_cpu  # noqa: F401  (an autouse fixture)


@pytest.fixture(scope="session")
def prepared_dir(tmp_path_factory):
    """The default model (from its registry package), prepared once per run into the session's model cache."""
    started = time.perf_counter()
    model_dir = resolve_model(None, tmp_path_factory.getbasetemp() / "model-cache", progress=False)
    print(f"\ndefault model ready in {time.perf_counter() - started:.1f} s at {model_dir}")
    return model_dir


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random llama checkpoint (4 query heads over 2 KV heads), written once per run; torch on one thread.
    Modules that need another architecture define their own `tiny_dir`."""
    import torch

    from deepinfer.testing.checkpoints import make_tiny_checkpoint

    torch.set_num_threads(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="session")
def block_bytes(tiny_dir) -> int:
    """Bytes of one KV block of `tiny_dir` at block size 4 (what the host-tier tests size their pools by)."""
    from deepinfer.engine.args import EngineArgs
    from deepinfer.engine.core import EngineCore

    return EngineCore(EngineArgs(model=str(tiny_dir), block_size=4, progress=False, max_model_len=32,
                                 kv_cache_bytes=16 << 20)).kv_plan.bytes_per_block
