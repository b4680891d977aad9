"""Test doubles for unit tests (STYLE.md: small interfaces with a fake beside them).

The fakes load on first use, so `deepinfer.testing.checkpoints*` import on a bare GPU image (torch,
transformers, tokenizers) without the bus's dependencies (nats-py, opentelemetry).
"""

from __future__ import annotations

from typing import Any

__all__ = ["FakeBroker", "FakeBus", "FakeMsg", "FakeSubscription", "subject_matches"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from deepinfer.testing import fake_bus

        return getattr(fake_bus, name)
    raise AttributeError(f"module 'deepinfer.testing' has no attribute {name!r}")
