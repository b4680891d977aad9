"""Two benchmark results side by side: every figure both have, its change, and which got worse.

A result is any JSON object of nested figures (`bench/gpu/gpu.py`'s, `bench/serve/serve.py`'s). A figure is a numeric leaf
whose name says which way is better: throughputs and fractions of a limit (`*tok_s`, `*tflops`, `*gb_s`,
`*of_roofline`, `*over_offline`) go up, times (`*_ms`, `*_s`, also as `*_ms_p99`...) and prices (`usd_per*`) go down; other numbers (counts, sizes, settings) are not
figures. Limits and ceilings (`ceilings.*`, `*limit*`, `*roofline_tok_s`) describe the machine, not the code: they are
shown, so a slower lending of the same GPU is seen, and never counted as a regression.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: A figure is worse when it moved the wrong way by more than this fraction (a run's own noise is ~1-3%).
DEFAULT_TOLERANCE = 0.03

_HIGHER = ("tok_s", "_per_s", "tflops", "gb_s", "of_roofline", "over_offline")  # a rate before "_s"
_LOWER = ("_ms", "_s")
#: `generator.*`: the load generator's own lags (deepinfer.bench.generator), a property of the client machine.
_MACHINE = ("ceilings.", "limit", "roofline_tok_s", "generator.")
#: A statistic's suffix (`ttft_ms_p99`, `step_ms_mean`) or key (`ttft_ms.p99`): the direction is that of the name
#: before it.
_STATISTIC = re.compile(r"_(p\d+|mean|median|max|min)$")


@dataclass(frozen=True)
class Delta:
    """One figure in both results."""

    name: str
    before: float
    after: float
    #: +1: higher is better; -1: lower is better.
    better: int
    #: A property of the machine (ceilings, limits), shown but never a regression.
    machine: bool

    @property
    def ratio(self) -> float:
        """after / before (inf when before is 0 and after is not)."""
        if self.before == 0:
            return 1.0 if self.after == 0 else math.inf
        return self.after / self.before

    def worse(self, tolerance: float = DEFAULT_TOLERANCE) -> bool:
        """Moved the wrong way by more than `tolerance` (never for a machine figure)."""
        if self.machine:
            return False
        change = self.ratio - 1.0
        return change * self.better < -tolerance


#: A sweep point's own key (its first) and the short name its figures are filed under (`points.c=64.ttft_ms`).
POINT_KEYS = {"concurrency": "c", "rate": "rate", "time_scale": "x", "conversations": "conv", "turn": "turn"}


def point_name(point: dict) -> str:
    """`c=64`, `rate=4`, `x=0.5`, `conv=8`, `turn=2`: the point's key and value."""
    key = next(k for k in point if k in POINT_KEYS)
    value = point[key]
    return f"{POINT_KEYS[key]}={value:g}" if isinstance(value, float) else f"{POINT_KEYS[key]}={value}"


def figures(result: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted name, value) of every numeric leaf under dicts, and under lists of sweep points (dicts named by
    their key, POINT_KEYS: `points.c=64.output_tok_s`); other lists and strings are not figures."""
    if isinstance(result, dict):
        for key, value in result.items():
            nested = isinstance(value, dict) or _is_sweep(value)
            yield from figures(value, f"{prefix}{key}." if nested else f"{prefix}{key}")
    elif _is_sweep(result):
        for point in result:
            yield from figures(point, f"{prefix}{point_name(point)}.")
    elif isinstance(result, int | float) and not isinstance(result, bool) and prefix:
        yield prefix, float(result)


def _is_sweep(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(p, dict) and any(k in p for k in POINT_KEYS) for p in value)
    )


def direction(name: str) -> int:
    """+1 if a higher value is better, -1 if lower is, 0 if the number is not a figure."""
    parts = name.split(".")
    leaf = parts[-1]
    if _STATISTIC.fullmatch(f"_{leaf}") and len(parts) > 1:  # `ttft_ms.p99`: the statistic of `ttft_ms`
        leaf = parts[-2]
    leaf = _STATISTIC.sub("", leaf)
    if leaf.startswith("usd_per"):  # a price (deepinfer.bench.cost)
        return -1
    if leaf.endswith(_HIGHER):
        return 1
    if leaf.endswith(_LOWER):
        return -1
    return 0


def compare(before: dict, after: dict) -> list[Delta]:
    """The figures present in both results, in `after`'s order."""
    old = dict(figures(before))
    deltas = []
    for name, value in figures(after):
        better = direction(name)
        if better and name in old:
            machine = any(marker in name for marker in _MACHINE)
            deltas.append(Delta(name, old[name], value, better, machine))
    return deltas


def table(deltas: list[Delta], tolerance: float = DEFAULT_TOLERANCE) -> str:
    """A plain-text table: figure, before, after, after/before, and WORSE where a figure regressed."""
    width = max([len("figure"), *(len(d.name) for d in deltas)])
    lines = [f"{'figure':{width}s} {'before':>12s} {'after':>12s} {'after/before':>12s}"]
    for d in deltas:
        mark = "  WORSE" if d.worse(tolerance) else ("  (machine)" if d.machine else "")
        lines.append(f"{d.name:{width}s} {d.before:>12.6g} {d.after:>12.6g} {d.ratio:>12.3f}{mark}")
    return "\n".join(lines)
