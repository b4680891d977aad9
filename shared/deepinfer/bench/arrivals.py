"""When an open-loop load sends each request, as offsets in seconds from the point's start (no clock read here).

- Poisson: exponential gaps of mean 1/rate drawn from a seeded generator (vLLM's `bench serve --request-rate`),
  the first request at the first gap, so the same seed gives the same schedule.
- A trace: each line's `timestamp` (ms) less the first line's, times `time_scale` (0.5 replays twice as fast).
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def poisson_offsets(rate: float, num_requests: int, seed: int = 0) -> list[float]:
    """`num_requests` arrival offsets of a Poisson process of `rate` requests per second."""
    if rate <= 0:
        raise ValueError(f"a request rate must be positive, got {rate}")
    rng = random.Random(seed)
    offsets, now_s = [], 0.0
    for _ in range(num_requests):
        now_s += rng.expovariate(rate)
        offsets.append(now_s)
    return offsets


def trace_offsets(timestamps_ms: Sequence[float], time_scale: float = 1.0) -> list[float]:
    """Offsets of a trace's lines from its first, scaled by `time_scale`."""
    if time_scale < 0:
        raise ValueError(f"a time scale cannot be negative, got {time_scale}")
    if not timestamps_ms:
        return []
    first = min(timestamps_ms)
    return [(t - first) / 1e3 * time_scale for t in timestamps_ms]
