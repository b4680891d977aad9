"""A `deepinfer bench run` result: one JSON object (schema below) and the same points as CSV rows.

    {"bench": "deepinfer-bench-run", "schema": 2, "date": "...", "base_url": "...", "model": "...",
     "workload": "concurrency" | "rate" | "trace" | "multiturn",
     "settings": {<what the workload was made of: num_prompts, input_words, max_tokens, ignore_eos, seed; a
                  trace's file and block_size; a conversation's turns; processes, gpus, gpu_hour_usd,
                  price_weights>},
     "points": [{<the point's key: "concurrency": c | "rate": req/s | "time_scale": f | "conversations": n>,
                 <deepinfer.bench.metrics.summarize's keys>,
                 "output_tok_s_per_gpu": tok/s, "cost": <with --gpu-hour-usd: deepinfer.bench.cost.cost>,
                 "cdf_ms": {"ttft": [101 quantiles, p0..p100, ms], "itl": [...]} (the CDF plots),
                 "generator": <deepinfer.bench.generator.generator_report: processes, cpu_share, loop_lag_ms,
                               send_lag_ms (open loop), bottleneck, reasons>,
                 "turns": [<multiturn only: deepinfer.bench.metrics.per_turn's rows>]}, ...]}

The CSV has one row per point: its key, then every figure with nested names joined by "_" (`ttft_ms_p99`); lists
(a conversation's turns) stay in the JSON. `deepinfer bench compare` reads two such files (a point's figures are
compared by its key, deepinfer.bench.compare.POINT_KEYS). deepinfer.bench.plots draws the PNGs from the JSON.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

SCHEMA = 2


def flat(point: dict, prefix: str = "") -> dict[str, object]:
    """A point's figures with nested names joined by "_" (lists left out)."""
    out: dict[str, object] = {}
    for key, value in point.items():
        if isinstance(value, list):
            continue
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}_")
        else:
            out[f"{prefix}{key}"] = value
    return out


def write(result: dict, json_path: Path, csv_path: Path | None) -> None:
    """The JSON (nan as null, so any JSON reader takes it) and, if asked, the CSV."""
    json_path.write_text(json.dumps(_no_nan(result), indent=1, allow_nan=False) + "\n")
    if csv_path is not None:
        rows = [flat(point) for point in result["points"]]
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["concurrency"])
            writer.writeheader()
            writer.writerows(rows)


def _no_nan(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value
