"""Replay a Mooncake-format trace against a running stack's OpenAI API and measure what the router achieved.

Each request is a streamed /v1/completions with the trace's token ids as the prompt, `max_tokens` =
output_length and ignore_eos; `usage.prompt_tokens_details.cached_tokens` (the final chunk) is what the serving
worker found cached. Requests start at their timestamp × time_scale (0: as fast as `concurrency` allows, in trace
order), at most `concurrency` at once.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import httpx

from deepinfer.testing.traces import TraceRequest, ideal_cached_tokens, trace_tokens


@dataclass
class Outcome:
    """One replayed request."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    error: str = ""


@dataclass
class ReplayResult:
    """A replay's totals; hit and ideal fractions are of all prompt tokens."""

    label: str
    num_requests: int
    num_errors: int
    prompt_tokens: int
    cached_tokens: int
    ideal_cached_tokens: int
    hit_fraction: float
    ideal_fraction: float
    of_ideal: float
    ttft_p50_s: float
    ttft_p90_s: float
    output_tokens_per_s: float
    wall_s: float
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        """One JSON line."""
        return json.dumps(asdict(self), sort_keys=True)


async def replay(
    base_url: str,
    model: str,
    requests: Sequence[TraceRequest],
    block_size: int,
    vocab_size: int,
    *,
    label: str = "",
    concurrency: int = 1,
    time_scale: float = 0.0,
    think_s: float = 0.0,
    salt: int = 0,
    api_key: str = "replay",
    timeout_s: float = 120.0,
) -> ReplayResult:
    """Replay `requests` (module docstring) and total the outcomes."""
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {api_key}"}
    outcomes: list[Outcome] = [Outcome() for _ in requests]
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s) as client:

        async def send(i: int) -> None:
            request = requests[i]
            delay_s = request.timestamp / 1000 * time_scale - (time.perf_counter() - started)
            if time_scale > 0 and delay_s > 0:
                await asyncio.sleep(delay_s)
            elif think_s > 0:  # a user's pause between requests: the workers' load reports catch up
                await asyncio.sleep(think_s)
            outcomes[i] = await _complete(client, model, trace_tokens(request, block_size, vocab_size, salt), request)

        todo = iter(range(len(requests)))

        async def client_loop() -> None:  # takes the next request in trace order: at most `concurrency` at once
            for i in todo:
                await send(i)

        await asyncio.gather(*(client_loop() for _ in range(max(1, concurrency))))
    return summarize(label, requests, list(outcomes), block_size, time.perf_counter() - started)


async def _complete(client: httpx.AsyncClient, model: str, prompt: list[int], request: TraceRequest) -> Outcome:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max(1, request.output_length), "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    outcome = Outcome(prompt_tokens=len(prompt))
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/completions", json=body) as response:
            if response.status_code != 200:
                outcome.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and not outcome.ttft_s:
                    outcome.ttft_s = time.perf_counter() - sent
                usage = chunk.get("usage")
                if usage:
                    outcome.output_tokens = usage["completion_tokens"]
                    outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


def summarize(
    label: str, requests: Sequence[TraceRequest], outcomes: list[Outcome], block_size: int, wall_s: float
) -> ReplayResult:
    """Totals of a replay against the trace's ideal."""
    ideal = ideal_cached_tokens(requests, block_size)
    prompt_tokens = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    ttfts = sorted(o.ttft_s for o in outcomes if not o.error)
    errors = [o.error for o in outcomes if o.error]
    ideal_total = sum(ideal)
    return ReplayResult(
        label=label,
        num_requests=len(outcomes),
        num_errors=len(errors),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        ideal_cached_tokens=ideal_total,
        hit_fraction=cached / prompt_tokens if prompt_tokens else 0.0,
        ideal_fraction=ideal_total / prompt_tokens if prompt_tokens else 0.0,
        of_ideal=cached / ideal_total if ideal_total else 0.0,
        ttft_p50_s=statistics.median(ttfts) if ttfts else 0.0,
        ttft_p90_s=ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else 0.0,
        output_tokens_per_s=sum(o.output_tokens for o in outcomes) / wall_s if wall_s else 0.0,
        wall_s=wall_s,
        errors=errors[:5],
    )


def table(results: Sequence[ReplayResult]) -> str:
    """A fixed-width table, one row per replay."""
    lines = [f"{'policy':<14}{'requests':>9}{'errors':>7}{'hit':>8}{'ideal':>8}{'of ideal':>9}"
             f"{'TTFT p50':>10}{'TTFT p90':>10}{'out tok/s':>11}"]
    for r in results:
        lines.append(f"{r.label:<14}{r.num_requests:>9}{r.num_errors:>7}{r.hit_fraction:>8.3f}"
                     f"{r.ideal_fraction:>8.3f}{r.of_ideal:>9.3f}{r.ttft_p50_s * 1000:>8.0f}ms"
                     f"{r.ttft_p90_s * 1000:>8.0f}ms{r.output_tokens_per_s:>11.1f}")
    return "\n".join(lines)
