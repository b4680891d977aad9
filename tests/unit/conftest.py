"""Unit-tier fixtures shared by several modules."""

from __future__ import annotations

import time

import pytest

from deepinfer.model_store import resolve_model


@pytest.fixture(scope="session")
def prepared_dir(tmp_path_factory):
    """The default model (from its registry package), prepared once per run into the session's model cache."""
    started = time.perf_counter()
    model_dir = resolve_model(None, tmp_path_factory.getbasetemp() / "model-cache", progress=False)
    print(f"\ndefault model ready in {time.perf_counter() - started:.1f} s at {model_dir}")
    return model_dir
