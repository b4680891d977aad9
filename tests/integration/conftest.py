"""Integration-tier fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _float32_on_every_cpu():
    """dtype "auto" resolves to float32 on the CPU in this tier, as on a CPU without bf16 instructions: results
    (parity with transformers, KV bytes per block) then do not depend on the host's instruction set. The e2e tier
    and `make demo` run the real default (bfloat16 where the CPU has bf16 instructions)."""
    from deepinfer.engine import args

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(args, "has_bf16_instructions", lambda: False)
        yield
