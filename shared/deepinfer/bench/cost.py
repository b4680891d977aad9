"""What a sweep point's tokens cost at a given price of GPU time (InferenceX's cost per million tokens).

A point ran `gpus` GPUs for its wall time: cost_usd = gpus × gpu_hour_usd × wall_s / 3600. Two views of it:

- all on output (`usd_per_m_output_all_in`): cost_usd / output tokens × 1e6, what InferenceX plots; input is
  free in this view, so compare it only between runs of the same input lengths.
- a break-even price list: prices per million uncached input, cached input and output tokens in fixed ratios
  (`weights`, by default a cached input token at 0.1 of an uncached one and an output token at 4: the ratios of
  public API price lists), scaled so the point's tokens at those prices pay exactly cost_usd:

      p_uncached × (uncached + w_cached × cached + w_output × output) = cost_usd
      p_cached = w_cached × p_uncached,  p_output = w_output × p_uncached

Both divide by tokens the server reported (usage), so a server that hides cached tokens shows none cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepinfer.bench.compare import point_name


@dataclass(frozen=True)
class Weights:
    """A price list's ratios to the price of an uncached input token."""

    cached_input: float = 0.1
    output: float = 4.0


def per_gpu(point: dict, gpus: int) -> dict:
    """Output tokens per second per GPU (the y of the throughput-vs-interactivity plot)."""
    return {"output_tok_s_per_gpu": round(point["output_tok_s"] / gpus, 3) if gpus > 0 else math.nan}


def cost(point: dict, gpu_hour_usd: float, gpus: int, weights: Weights = Weights()) -> dict:
    """The point's `cost` figures (module docstring); nan where a class has no tokens."""
    cost_usd = gpus * gpu_hour_usd * point["wall_s"] / 3600
    cached = point["cached_tokens"]
    uncached = point["prompt_tokens"] - cached
    output = point["output_tokens"]
    units = uncached + weights.cached_input * cached + weights.output * output
    uncached_usd = cost_usd / units * 1e6 if units > 0 else math.nan

    def rounded(value: float) -> float:
        return round(value, 6) if not math.isnan(value) else math.nan

    return {
        "cost_usd": round(cost_usd, 6),
        "usd_per_m_input_uncached": rounded(uncached_usd),
        "usd_per_m_input_cached": rounded(weights.cached_input * uncached_usd),
        "usd_per_m_output": rounded(weights.output * uncached_usd),
        "usd_per_m_output_all_in": rounded(cost_usd / output * 1e6 if output else math.nan),
    }


#: The price columns of the printed table, in order.
_PRICES = (
    "usd_per_m_input_uncached",
    "usd_per_m_input_cached",
    "usd_per_m_output",
    "usd_per_m_output_all_in",
)


def cost_table(points: list[dict]) -> str:
    """The printed summary: one row per point with its prices, in $ per million tokens."""
    rows = [("point", "in uncached", "in cached", "output", "output all-in", "out tok/s/GPU")]
    for point in points:
        prices = (f"{point['cost'][k]:.4g}" for k in _PRICES)
        rows.append((point_name(point), *prices, f"{point['output_tok_s_per_gpu']:.4g}"))
    widths = [max(len(cell) for cell in column) for column in zip(*rows, strict=True)]
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    return "\n".join(["$ per million tokens", *lines])
