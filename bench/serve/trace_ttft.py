"""Where a request's time to first token goes, from the file exporter's spans (one trace per request).

    PYTHONPATH=shared:. python bench/serve/trace_ttft.py LOG_DIR/traces [--out FILE]

For every trace with a `gateway.request` span, the first token's critical path, as offsets from the request's
start (ms): tokenize, route, prefill (if any), decode admission (gateway side, and the decode worker's span
inside it), the first token batch published by the decode worker (`decode.token_batch` start = its step's
outputs reached the worker's event loop; end = published), the first SSE write at the gateway. Prints p50 of
each offset and segment over the traces, and one JSON line. (bench/serve/serve.py --trace --log-dir DIR writes
DIR/traces.)
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from bench.results_io import emit_json_line

MARKS = [  # (label, span name, which end, first or last of that name)
    ("tokenize_end", "gateway.tokenize", "end_ns"),
    ("route_start", "gateway.route", "start_ns"),
    ("route_end", "gateway.route", "end_ns"),
    ("prefill_end", "gateway.prefill", "end_ns"),
    ("admission_sent", "gateway.decode_admission", "start_ns"),
    ("decode_received", "decode.admission", "start_ns"),
    ("decode_replied", "decode.admission", "end_ns"),
    ("admission_reply", "gateway.decode_admission", "end_ns"),
    ("first_batch_at_loop", "decode.token_batch", "start_ns"),
    ("first_batch_published", "decode.token_batch", "end_ns"),
    ("first_sse_written", "gateway.sse_write", "end_ns"),
]


def load(trace_dir: Path) -> dict[str, list[dict]]:
    """Spans by trace id, from every *.jsonl file in `trace_dir`."""
    traces: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                span = json.loads(line)
                traces[span["trace_id"]].append(span)
    return traces


def offsets(spans: list[dict]) -> dict[str, float] | None:
    """Each mark's offset (ms) from the request's start; None without a gateway.request span."""
    root = next((s for s in spans if s["name"] == "gateway.request"), None)
    if root is None:
        return None
    marks = {"request_end": (root["end_ns"] - root["start_ns"]) / 1e6}
    for label, name, end in MARKS:
        times = [s[end] for s in spans if s["name"] == name]
        if times:
            marks[label] = (min(times) - root["start_ns"]) / 1e6
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = [o for o in (offsets(spans) for spans in load(args.trace_dir).values()) if o]
    labels = ["tokenize_end"] + [label for label, _, _ in MARKS[1:]] + ["request_end"]
    summary: dict[str, float] = {}
    print(f"{len(rows)} requests; offsets from the gateway's request start, p50 ms (and the step from the mark before)")
    previous = 0.0
    for label in labels:
        values = [row[label] for row in rows if label in row]
        if not values:
            continue
        p50 = statistics.median(values)
        summary[label] = round(p50, 3)
        print(f"  {label:24s} {p50:9.2f}   +{p50 - previous:8.2f}")
        previous = p50
    emit_json_line({"bench": "trace_ttft", "requests": len(rows), "offset_ms_p50": summary}, args.out)


if __name__ == "__main__":
    main()
