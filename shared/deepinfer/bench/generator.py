"""Plays a sweep point's plan (deepinfer.bench.load) and returns its records and wall time."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from deepinfer.bench.load import Plan
from deepinfer.bench.metrics import RequestRecord


@dataclass
class Outcome:
    """A point's records and its wall time, from the start to the last answer's end."""

    records: list[RequestRecord]
    wall_s: float


def execute(plan: Plan, base_url: str, timeout_s: float = 600.0) -> Outcome:
    """Play `plan` in this process."""
    start_s = time.monotonic()
    records = asyncio.run(_play(plan, base_url, start_s, timeout_s))
    return Outcome(records, time.monotonic() - start_s)


async def _play(plan: Plan, base_url: str, start_s: float, timeout_s: float) -> list[RequestRecord]:
    # open-loop and conversation loads hold a connection per request in flight: no pool limit
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        return await plan.run(client, base_url, start_s, lambda record: None)
