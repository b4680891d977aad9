"""Fold a py-spy raw profile (`py-spy record --format raw --threads`) into a short text summary per thread.

    python -m deepinfer.bench.pyspy_summary PROFILE.txt [--top 25] [--match FRAME] > SUMMARY.txt

The raw file of a few seconds at 1-2 kHz is tens of MB, more than a device call can bring back; the summary is
a few KB. Per thread (the stack's first frame, `thread (...)`): its samples, then the top frames by self share
("leaf": the stack's last frame) and by inclusive share ("incl": anywhere in the stack, once per stack).
`--match` keeps only the stacks with a frame containing that text (e.g. `step_ms` for bench/gpu/mixed_step.py's
timed steps, without the engine's start).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def short(frame: str) -> str:
    """`func (path/to/file.py:12)` -> `func file.py:12`."""
    match = _FRAME.match(frame)
    if match is None:
        return frame
    name = Path(match["file"]).name
    return f"{match['func']} {name}:{match['line']}" if match["line"] else f"{match['func']} {name}"


def fold(lines: list[str], match: str | None) -> dict[str, tuple[int, Counter[str], Counter[str]]]:
    """Thread -> (samples, leaf counts, inclusive counts)."""
    samples: dict[str, int] = defaultdict(int)
    leaves: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    for line in lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit() or (match is not None and match not in stack):
            continue
        count, frames = int(count_text), stack.split(";")
        thread = frames[0] if frames[0].startswith("thread") else "all"
        code = [short(f) for f in (frames[1:] if thread != "all" else frames)]
        samples[thread] += count
        if code:
            leaves[thread][code[-1]] += count
        for frame in set(code):
            inclusive[thread][frame] += count
    return {t: (samples[t], leaves[t], inclusive[t]) for t in samples}


def render(folded: dict[str, tuple[int, Counter[str], Counter[str]]], top: int) -> str:
    out = []
    for thread, (total, leaves, inclusive) in sorted(folded.items(), key=lambda item: -item[1][0]):
        out.append(f"== {thread}: {total} samples")
        for label, counts in (("leaf", leaves), ("incl", inclusive)):
            for frame, count in counts.most_common(top):
                out.append(f"  {label} {100 * count / total:5.1f}% {frame}")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--match", default=None, help="keep only stacks with a frame containing this text")
    args = parser.parse_args()
    lines = args.profile.read_text(errors="replace").splitlines()
    print(render(fold(lines, args.match), args.top), end="")


if __name__ == "__main__":
    main()
