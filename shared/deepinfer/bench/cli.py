"""`deepinfer bench`: `run` a load against any OpenAI-compatible server (a concurrency sweep, a Poisson request-rate
sweep, a Mooncake trace replay or multi-turn conversations; JSON and CSV), with `--up` against a local stack it
starts for the run (`deepinfer up`'s, `deepinfer.up.cli.local_stack`) and stops after, and
`compare` two result files (exit 1 when a figure got worse by more than the tolerance, so a script or CI step
can stop on a slower commit)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from deepinfer.bench.compare import DEFAULT_TOLERANCE, compare, point_name, table
from deepinfer.bench.prompts import MOONCAKE_BLOCK_SIZE
from deepinfer.config import DEFAULT_MODEL
from deepinfer.up.cli import add_stack_arguments

if TYPE_CHECKING:
    from deepinfer.bench.generator import Outcome


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`run` and `compare` and their arguments."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    run_parser = sub.add_parser(
        "run",
        help="a load sweep against an OpenAI-compatible server: concurrency (default), --rate, --trace or "
        "--conversations",
    )
    run_parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    run_parser.add_argument(
        "--model",
        default=None,
        help=f"default: the first model the server lists (--up: the model to serve, default {DEFAULT_MODEL})",
    )
    stack = run_parser.add_argument_group(
        "a local stack", "--up starts the stack `deepinfer up` runs, for this run only (instead of --base-url)"
    )
    stack.add_argument("--up", action="store_true", help="start a local stack, run against it, stop it")
    add_stack_arguments(stack, default_port=0)
    workload = run_parser.add_mutually_exclusive_group()
    workload.add_argument(
        "--concurrency",
        default="1,4,16",
        help="closed loop: comma-separated client counts, one point each (the default workload)",
    )
    workload.add_argument(
        "--rate", default=None, help="open loop: comma-separated Poisson request rates (req/s)"
    )
    workload.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="open loop: replay a Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids)",
    )
    workload.add_argument(
        "--conversations",
        default=None,
        help="multi-turn: comma-separated numbers of concurrent conversations, one point each",
    )
    run_parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per point (default 32; a trace: all its lines)",
    )
    run_parser.add_argument(
        "--input-words", type=int, default=200, help="words per prompt (per user message)"
    )
    run_parser.add_argument(
        "--max-tokens", type=int, default=64, help="per request (a trace: its output_length)"
    )
    run_parser.add_argument(
        "--ignore-eos", action="store_true", help="vLLM's extension: exactly max_tokens each"
    )
    run_parser.add_argument("--seed", type=int, default=0, help="the prompts' and the arrivals' seed")
    run_parser.add_argument(
        "--time-scale",
        default="1",
        help="--trace: comma-separated factors on its timestamps, one point each (0.5: 2x as fast)",
    )
    run_parser.add_argument(
        "--block-size",
        type=int,
        default=MOONCAKE_BLOCK_SIZE,
        help=f"--trace: words per hash id (default {MOONCAKE_BLOCK_SIZE}, Mooncake's tokens)",
    )
    run_parser.add_argument("--turns", type=int, default=4, help="--conversations: turns per conversation")
    run_parser.add_argument(
        "--processes", type=int, default=1, help="deal each point's load over this many generator processes"
    )
    run_parser.add_argument(
        "--gpus", type=int, default=1, help="GPUs behind the server (per-GPU throughput, cost)"
    )
    run_parser.add_argument(
        "--gpu-hour-usd",
        type=float,
        default=None,
        help="$ per GPU-hour: adds $ per million tokens to every point",
    )
    run_parser.add_argument(
        "--plots", type=Path, default=None, help="the PNGs' path prefix (default: --out without .json)"
    )
    run_parser.add_argument("--no-plots", action="store_true", help="write no PNG")
    run_parser.add_argument("--out", type=Path, default=Path("bench-run.json"), help="the JSON result")
    run_parser.add_argument("--csv", type=Path, default=None, help="also the points as CSV")
    run_parser.set_defaults(_bench=run_sweep)
    compare_parser = sub.add_parser(
        "compare", help="two result JSON files side by side; exit 1 if a figure got worse"
    )
    compare_parser.add_argument("before", type=Path)
    compare_parser.add_argument("after", type=Path)
    compare_parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help=f"worse means by more than this fraction (default {DEFAULT_TOLERANCE})",
    )
    compare_parser.add_argument(
        "--plots",
        type=Path,
        default=None,
        help="also draw both runs on one set of PNGs with this path prefix",
    )
    compare_parser.set_defaults(_bench=run_compare)


def run(args: argparse.Namespace) -> int:
    return args._bench(args)


def run_sweep(args: argparse.Namespace) -> int:
    """The sweep against --base-url, or with --up against a local stack started for it and stopped after."""
    for path in (args.out, args.csv, args.plots):  # made before the run, not found missing after it
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    if not args.up:
        return sweep_against(args, args.base_url.rstrip("/"), args.model)
    from deepinfer.up.cli import PortInUse, StopRequested, local_stack
    from deepinfer.up.stack import StackError

    up_args = argparse.Namespace(**{**vars(args), "model": args.model or DEFAULT_MODEL})
    try:
        with local_stack(up_args, echo_logs=False) as stack:
            return sweep_against(args, stack.base_url.removesuffix("/v1"), stack.model_name)
    except PortInUse as exc:
        print(f"deepinfer: {exc}", file=sys.stderr)
        return 2
    except StackError:
        return 2  # local_stack logged why
    except StopRequested:
        return 1  # local_stack said so and stopped the stack


def sweep_against(args: argparse.Namespace, base_url: str, model: str | None) -> int:
    """One point per level of the workload, a line of summary each; the JSON (and CSV) written after every point.
    `model=None`: the first model the server lists."""
    import httpx

    from deepinfer.bench.cost import cost_table
    from deepinfer.bench.generator import Progress, execute
    from deepinfer.bench.report import SCHEMA, write
    from deepinfer.bench.workloads import settings, sweep

    try:
        model = model or asyncio.run(_first_model(base_url))
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"deepinfer: cannot list the models of {base_url}: {exc}", file=sys.stderr)
        return 2
    try:
        name, points = sweep(args, model)
    except (OSError, ValueError, KeyError) as exc:
        print(f"deepinfer: {exc}", file=sys.stderr)
        return 2
    result = {
        "bench": "deepinfer-bench-run",
        "schema": SCHEMA,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "base_url": base_url,
        "model": model,
        "workload": name,
        "settings": settings(args, name),
        "points": [],
    }
    for label, plan in points:
        outcome = execute(plan, base_url, args.processes, Progress(point_name(label), plan.num_requests))
        point = measure(label, outcome, args)
        result["points"].append(point)
        write(result, args.out, args.csv)
        print(summary_line(point), flush=True)
        for reason in point["generator"]["reasons"]:
            print(f"  the load generator may have been the bottleneck: {reason}", file=sys.stderr)
        errors = [r.error for r in outcome.records if r.error]
        if errors:
            print(f"  first error: {errors[0]}", file=sys.stderr)
    if args.gpu_hour_usd is not None:
        print(
            f"\nat ${args.gpu_hour_usd:g} per GPU-hour, {args.gpus} GPU(s):\n{cost_table(result['points'])}"
        )
    print(f"wrote {args.out}" + (f" and {args.csv}" if args.csv else ""))
    if not args.no_plots:
        plot([(model, result)], args.plots or args.out.with_suffix(""))
    return 1 if any(p["num_failed"] for p in result["points"]) else 0


def measure(label: dict, outcome: Outcome, args: argparse.Namespace) -> dict:
    """A point's JSON: its key, the figures of its records, per GPU and cost, the generator's own check, the CDFs'
    quantiles, and a conversation load's turns."""
    from deepinfer.bench.cost import cost, per_gpu
    from deepinfer.bench.generator import generator_report
    from deepinfer.bench.metrics import per_turn, quantiles_ms, summarize

    point = label | summarize(outcome.records, outcome.wall_s)
    point |= per_gpu(point, args.gpus)
    if args.gpu_hour_usd is not None:
        point["cost"] = cost(point, args.gpu_hour_usd, args.gpus)
    point["generator"] = generator_report(outcome)
    done = [r for r in outcome.records if r.error is None]
    point["cdf_ms"] = {
        "ttft": quantiles_ms([r.ttft_s for r in done]),
        "itl": quantiles_ms([gap for r in done for gap in r.itl_s()]),
    }
    if any(r.turn is not None for r in outcome.records):
        point["turns"] = per_turn(outcome.records)
    return point


def summary_line(point: dict) -> str:
    """One line per point: its name, throughput, latencies and failures."""
    generator = "generator BOTTLENECK" if point["generator"]["bottleneck"] else "generator ok"
    return (
        f"{point_name(point)}: {point['output_tok_s']} out tok/s, {point['output_tok_s_per_user']} per user, "
        f"TTFT p50 {point['ttft_ms']['p50']} ms, ITL p50 {point['itl_ms']['p50']} ms, "
        f"{point['num_failed']} failed of {point['num_requests']}, {generator}"
    )


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
    if args.plots:
        names = (args.before.stem, args.after.stem)
        if names[0] == names[1]:
            names = (str(args.before), str(args.after))
        plot([(names[0], before), (names[1], after)], args.plots)
    worse = [d.name for d in deltas if d.worse(args.tolerance)]
    if worse:
        print(f"\n{len(worse)} figure(s) worse by more than {args.tolerance:.0%}: {', '.join(worse)}")
    return 1 if worse else 0


def plot(results: list[tuple[str, dict]], prefix: Path) -> None:
    """The PNGs (deepinfer.bench.plots), or a line saying why there are none."""
    from deepinfer.bench.plots import available, draw

    if not available():
        print("no plots: matplotlib is not installed (pip install 'deepinfer[bench]')", file=sys.stderr)
        return
    if not all(result.get("points") for _, result in results):
        print("no plots: a result has no sweep points", file=sys.stderr)
        return
    print("plots: " + ", ".join(str(path) for path in draw(results, prefix)))
