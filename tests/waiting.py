"""Waiting for a condition with a generous deadline instead of sleeping a fixed time before an assertion: a sleep
long enough on an idle machine is not on a busy one, and a deadline costs nothing when the condition comes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    """Poll `predicate` every 10 ms until it holds; fail naming `what` after `timeout_s`."""
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)
