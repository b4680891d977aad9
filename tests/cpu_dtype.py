"""The unit and integration tiers' dtype on the CPU, imported by their conftest.py files."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def float32_on_every_cpu():
    """dtype "auto" resolves to float32 on the CPU in the tier, as on a CPU without bf16 instructions: results
    (parity with transformers, KV bytes per block) then do not depend on the host's instruction set. The e2e tier
    pins float32 on its stacks by env (STACK_ENV); `make demo` runs the real default (bfloat16 where the CPU has
    bf16 instructions)."""
    from deepinfer.engine import args

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(args, "has_bf16_instructions", lambda: False)
        yield
