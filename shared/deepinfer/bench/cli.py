"""`deepinfer bench`: `run` a load against any OpenAI-compatible server (a concurrency sweep; JSON and CSV) and
`compare` two result files (exit 1 when a figure got worse by more than the tolerance, so a script or CI step
can stop on a slower commit)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from deepinfer.bench.compare import DEFAULT_TOLERANCE, compare, table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`run` and `compare` and their arguments."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    run_parser = sub.add_parser("run", help="a closed-loop concurrency sweep against an OpenAI-compatible server")
    run_parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    run_parser.add_argument("--model", default=None, help="default: the first model the server lists")
    run_parser.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts, one point each")
    run_parser.add_argument("--num-prompts", type=int, default=32, help="requests per point")
    run_parser.add_argument("--input-words", type=int, default=200, help="words per prompt")
    run_parser.add_argument("--max-tokens", type=int, default=64)
    run_parser.add_argument("--ignore-eos", action="store_true", help="vLLM's extension: exactly max_tokens each")
    run_parser.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    run_parser.add_argument("--out", type=Path, default=Path("bench-run.json"), help="the JSON result")
    run_parser.add_argument("--csv", type=Path, default=None, help="also the points as CSV")
    run_parser.set_defaults(_bench=run_sweep)
    compare_parser = sub.add_parser("compare", help="two result JSON files side by side; exit 1 if a figure got worse")
    compare_parser.add_argument("before", type=Path)
    compare_parser.add_argument("after", type=Path)
    compare_parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                                help=f"worse means by more than this fraction (default {DEFAULT_TOLERANCE})")
    compare_parser.set_defaults(_bench=run_compare)


def run(args: argparse.Namespace) -> int:
    return args._bench(args)


def run_sweep(args: argparse.Namespace) -> int:
    """One point per concurrency, a line of progress each; the JSON (and CSV) written after every point."""
    import httpx

    from deepinfer.bench.load import make_prompts, run_point
    from deepinfer.bench.metrics import summarize
    from deepinfer.bench.report import SCHEMA, write

    try:
        levels = [int(c) for c in args.concurrency.split(",")]
        if min(levels) < 1:
            raise ValueError
    except ValueError:
        print(f"deepinfer: --concurrency takes positive integers, got {args.concurrency!r}", file=sys.stderr)
        return 2
    base_url = args.base_url.rstrip("/")
    try:
        model = args.model or asyncio.run(_first_model(base_url))
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"deepinfer: cannot list the models of {base_url}: {exc}", file=sys.stderr)
        return 2
    prompts = make_prompts(args.num_prompts, args.input_words, args.seed)
    result = {"bench": "deepinfer-bench-run", "schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "base_url": base_url, "model": model,
              "settings": {"num_prompts": args.num_prompts, "input_words": args.input_words,
                           "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "seed": args.seed},
              "points": []}
    for concurrency in levels:
        records, wall_s = asyncio.run(run_point(base_url, model, prompts, concurrency, args.max_tokens,
                                                args.ignore_eos))
        point = {"concurrency": concurrency, **summarize(records, wall_s)}
        result["points"].append(point)
        write(result, args.out, args.csv)
        print(f"c={concurrency}: {point['output_tok_s']} out tok/s, {point['output_tok_s_per_user']} per user, "
              f"TTFT p50 {point['ttft_ms']['p50']} ms, ITL p50 {point['itl_ms']['p50']} ms, "
              f"{point['num_failed']} failed of {point['num_requests']}", flush=True)
        errors = [r.error for r in records if r.error]
        if errors:
            print(f"  first error: {errors[0]}", file=sys.stderr)
    print(f"wrote {args.out}" + (f" and {args.csv}" if args.csv else ""))
    return 1 if any(p["num_failed"] for p in result["points"]) else 0


async def _first_model(base_url: str) -> str:
    import httpx

    from deepinfer.bench.load import first_model

    async with httpx.AsyncClient(timeout=30) as client:
        return await first_model(client, base_url)


def run_compare(args: argparse.Namespace) -> int:
    """Print the table; 0 when nothing got worse, 1 when something did, 2 on an unreadable file."""
    try:
        before, after = (json.loads(path.read_text()) for path in (args.before, args.after))
    except (OSError, ValueError) as exc:
        print(f"deepinfer: {exc}", file=sys.stderr)
        return 2
    deltas = compare(before, after)
    if not deltas:
        print("deepinfer: the two results have no figure in common", file=sys.stderr)
        return 2
    print(table(deltas, args.tolerance))
    worse = [d.name for d in deltas if d.worse(args.tolerance)]
    if worse:
        print(f"\n{len(worse)} figure(s) worse by more than {args.tolerance:.0%}: {', '.join(worse)}")
    return 1 if worse else 0
