"""`deepinfer bench compare BEFORE.json AFTER.json`: the figures of two results side by side (exit 1 when one got
worse by more than the tolerance, so a script or CI step can stop on a slower commit)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deepinfer.bench.compare import DEFAULT_TOLERANCE, compare, table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`compare` (the one bench subcommand so far) and its arguments."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    compare_parser = sub.add_parser("compare", help="two result JSON files side by side; exit 1 if a figure got worse")
    compare_parser.add_argument("before", type=Path)
    compare_parser.add_argument("after", type=Path)
    compare_parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                                help=f"worse means by more than this fraction (default {DEFAULT_TOLERANCE})")


def run(args: argparse.Namespace) -> int:
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
