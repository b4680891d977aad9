"""Per-hop breakdown of a serving run: from the services' hop histograms (always on, scraped before and after a
run) and, when the stack exports traces to files, from the spans themselves.

    before = scrape(stack); ...run...; hops = histogram_breakdown(before, scrape(stack))
    spans = span_breakdown(read_spans(stack.trace_dir), since_ns, until_ns)
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

_ENGINE_GAUGE = re.compile(r'^deepinfer_worker_(engine_steps|cuda_graph_replays) ([0-9.eE+-]+)$')
_BUCKET = re.compile(r'^deepinfer_(\w+)_hop_seconds_bucket\{hop="([^"]+)",le="([^"]+)"\} ([0-9.eE+-]+)$')
_STEP_BUCKET = re.compile(r'^deepinfer_worker_engine_step_seconds_bucket\{kind="(\w+)",le="([^"]+)"\} ([0-9.eE+-]+)$')

#: (service, hop) -> {upper bound (s): cumulative count}
Histograms = dict[tuple[str, str], dict[float, float]]


def scrape(internal_ports: dict[str, int]) -> Histograms:
    """Every service's hop histogram buckets, from its /metrics (name -> internal port)."""
    found: Histograms = defaultdict(dict)
    for port in internal_ports.values():
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for line in text.splitlines():
            match = _BUCKET.match(line)
            if match:
                service, hop, le, value = match.groups()
                bound = math.inf if le == "+Inf" else float(le)
                found[(service, hop)][bound] = found[(service, hop)].get(bound, 0.0) + float(value)
    return dict(found)


def engine_counts(internal_ports: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Each worker's engine steps and CUDA-graph replays so far, and its step-time histogram by step kind
    (`step_seconds`: kind -> {upper bound (s): cumulative count}), from its /metrics (name -> internal port)."""
    found: dict[str, dict[str, Any]] = {}
    for name, port in internal_ports.items():
        for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
            match = _ENGINE_GAUGE.match(line)
            if match:
                found.setdefault(name, {})[match.group(1)] = float(match.group(2))
            match = _STEP_BUCKET.match(line)
            if match:
                kind, le, value = match.groups()
                buckets = found.setdefault(name, {}).setdefault("step_seconds", {}).setdefault(kind, {})
                buckets[math.inf if le == "+Inf" else float(le)] = float(value)
    return found


def step_breakdown(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]],
                   wall_s: float) -> dict[str, dict[str, Any]]:
    """Per worker during a run: steps, the share that replayed a CUDA graph, the mean wall time of a step, and
    by step kind (decode / mixed / prefill) the count and the p50 / p99 of a step's time (`kinds`)."""
    rows: dict[str, dict[str, Any]] = {}
    for name, counts in after.items():
        steps = counts.get("engine_steps", 0.0) - before.get(name, {}).get("engine_steps", 0.0)
        if steps <= 0:
            continue
        graphs = counts.get("cuda_graph_replays", 0.0) - before.get(name, {}).get("cuda_graph_replays", 0.0)
        rows[name] = {"steps": int(steps), "graph_share": round(graphs / steps, 3),
                      "step_ms": round(wall_s * 1000 / steps, 3), "kinds": {}}
        old = before.get(name, {}).get("step_seconds", {})
        for kind, buckets in sorted(counts.get("step_seconds", {}).items()):
            delta = {le: n - old.get(kind, {}).get(le, 0.0) for le, n in buckets.items()}
            if delta.get(math.inf, 0.0) > 0:
                rows[name]["kinds"][kind] = {"count": int(delta[math.inf]),
                                             "p50_ms": round(_quantile(delta, 0.5) * 1000, 3),
                                             "p99_ms": round(_quantile(delta, 0.99) * 1000, 3)}
    return rows


def histogram_breakdown(before: Histograms, after: Histograms) -> list[dict[str, Any]]:
    """Count, p50 and p99 (ms, interpolated in the bucket as Prometheus does) of each hop during the run."""
    rows = []
    for key, buckets in sorted(after.items()):
        delta = {le: n - before.get(key, {}).get(le, 0.0) for le, n in buckets.items()}
        count = delta.get(math.inf, 0.0)
        if count <= 0:
            continue
        rows.append({"hop": f"{key[0]}.{key[1]}", "count": int(count),
                     "p50_ms": round(_quantile(delta, 0.5) * 1000, 3), "p99_ms": round(_quantile(delta, 0.99) * 1000, 3)})
    return rows


def _quantile(cumulative: dict[float, float], q: float) -> float:
    bounds = sorted(cumulative)
    total = cumulative[math.inf]
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == math.inf:
                return lower
            width = count - below
            return lower + (bound - lower) * ((rank - below) / width if width else 0.0)
        lower, below = bound, count
    return lower


def span_breakdown(spans: list[dict[str, Any]], since_ns: int, until_ns: int) -> list[dict[str, Any]]:
    """Count, p50 and p99 (ms) of span durations by name, for spans that started inside the window."""
    durations: dict[str, list[float]] = defaultdict(list)
    for span in spans:
        if since_ns <= span["start_ns"] <= until_ns:
            durations[span["name"]].append((span["end_ns"] - span["start_ns"]) / 1e6)
    rows = []
    for name, values in sorted(durations.items()):
        values.sort()
        rows.append({"hop": name, "count": len(values), "p50_ms": round(_rank(values, 50), 3),
                     "p99_ms": round(_rank(values, 99), 3)})
    return rows


def _rank(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each process has used so far, from /proc (name -> pid); Linux only."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return found


def cpu_fractions(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Each service's share of one core during a run."""
    return {name: round((after[name] - before[name]) / wall_s, 3) for name in after if name in before}


def print_hops(title: str, rows: list[dict[str, Any]]) -> None:
    """A small table of hops."""
    if not rows:
        return
    print(f"  {title:<34}{'count':>8}{'p50 ms':>10}{'p99 ms':>10}")
    for row in rows:
        print(f"  {row['hop']:<34}{row['count']:>8}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}")
