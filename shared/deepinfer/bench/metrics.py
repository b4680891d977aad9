"""What a serving benchmark reports, computed from each request's timestamps alone (no clock is read here).

A request's record is when it was sent, when each streamed chunk with output arrived, when it ended, and how many
output tokens it produced. From those, as vLLM's `bench serve` and guidellm define them:

    TTFT   = first output chunk − sent
    ITL    = the gaps between consecutive output chunks (every gap of every request, pooled)
    TPOT   = (end − first output chunk) / (output tokens − 1), per request with more than one token
    E2E    = end − sent
    output tok/s = Σ output tokens / the run's wall time;  per user = output tokens / E2E, per request (mean)

Percentiles interpolate linearly between order statistics (numpy's default), so two tools agree on the same data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's timestamps (seconds, one monotonic clock) and counts."""

    sent_s: float
    #: When an open-loop load meant to send it (same clock); nan in a closed loop.
    scheduled_s: float = math.nan
    #: Arrival time of every streamed chunk that carried output text, in order.
    chunk_s: list[float] = field(default_factory=list)
    end_s: float = math.nan
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: Why it failed (status and message); None when it completed.
    error: str | None = None
    #: The streamed output text (a conversation's next turn resends it).
    text: str = ""
    #: A conversation's turn (0 first); None outside conversations.
    turn: int | None = None

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.sent_s if self.chunk_s else math.nan

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2 or not self.chunk_s:
            return math.nan
        return (self.end_s - self.chunk_s[0]) / (self.output_tokens - 1)

    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics; nan for no values."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values: Sequence[float]) -> dict[str, float]:
    """mean and PERCENTILES of seconds, in milliseconds (rounded to µs)."""
    clean = [v for v in values if not math.isnan(v)]
    out = {"mean": round(1e3 * sum(clean) / len(clean), 3) if clean else math.nan}
    out |= {f"p{q}": round(1e3 * percentile(clean, q), 3) for q in PERCENTILES}
    return out


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict:
    """One sweep point's figures (module docstring) over the completed requests; failures counted apart."""
    done = [r for r in records if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    per_user = [r.output_tokens / r.e2e_s for r in done if r.e2e_s > 0]
    return {
        "num_requests": len(records),
        "num_failed": len(records) - len(done),
        "wall_s": round(wall_s, 4),
        "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "cached_tokens": sum(r.cached_tokens for r in done),
        "output_tok_s": round(output_tokens / wall_s, 3) if wall_s > 0 else math.nan,
        "requests_per_s": round(len(done) / wall_s, 4) if wall_s > 0 else math.nan,
        "output_tok_s_per_user": round(sum(per_user) / len(per_user), 3) if per_user else math.nan,
        "ttft_ms": distribution_ms([r.ttft_s for r in done]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s()]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done]),
    }


def per_turn(records: Sequence[RequestRecord]) -> list[dict]:
    """A conversation load's figures turn by turn: how much of each turn's prompt the server said it had cached
    (a prefix cache serves the resent history), and its TTFT."""
    turns = sorted({r.turn for r in records if r.turn is not None})
    out = []
    for turn in turns:
        done = [r for r in records if r.turn == turn and r.error is None]
        prompt_tokens, cached_tokens = sum(r.prompt_tokens for r in done), sum(r.cached_tokens for r in done)
        out.append(
            {
                "turn": turn,
                "num_requests": len(done),
                "prompt_tokens": prompt_tokens,
                "cached_tokens": cached_tokens,
                "cached_fraction": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else math.nan,
                "ttft_ms": distribution_ms([r.ttft_s for r in done]),
            }
        )
    return out


def quantiles_ms(values: Sequence[float], num: int = 101) -> list[float]:
    """`num` evenly spaced percentiles from 0 to 100 of seconds, in ms: the curve a CDF plot draws (the JSON
    keeps these, not every sample); empty for no values."""
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        return []
    return [round(1e3 * percentile(clean, 100 * i / (num - 1)), 3) for i in range(num)]
