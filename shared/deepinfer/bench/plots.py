"""PNG plots of one or more `deepinfer bench run` results (matplotlib, the optional `deepinfer[bench]` extra):

- `<prefix>-pareto.png`: output tok/s per GPU (y) against output tok/s per user (x), one marker per sweep point and
  the Pareto front through the points no other point beats on both (vLLM's `plot_pareto`, InferenceX's
  throughput against interactivity);
- `<prefix>-cdf.png`: the TTFT and ITL CDFs of every point (from the quantiles the JSON keeps, `cdf_ms`);
- `<prefix>-throughput.png`: output tok/s and TTFT p50 against the sweep's load (concurrency, rate, time scale or
  conversations).

Several results (`bench compare`) share each plot, one colour per result.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from deepinfer.bench.compare import POINT_KEYS, point_name


def available() -> bool:
    """Whether matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pareto_front(xy: Sequence[tuple[float, float]]) -> list[int]:
    """The indices of the points no other point beats or equals on both axes (higher is better on both), in
    order of x; points with a missing (nan/None) coordinate are never on it."""
    valid = [i for i, (x, y) in enumerate(xy) if x is not None and y is not None and x == x and y == y]
    front: list[int] = []
    for i in valid:
        (xi, yi) = xy[i]
        beaten = any(xj >= xi and yj >= yi and (xj, yj) != (xi, yi) for xj, yj in (xy[j] for j in valid))
        if not beaten and all(xy[k] != xy[i] for k in front):  # a repeated point once
            front.append(i)
    return sorted(front, key=lambda i: xy[i][0])


#: The throughput plot's x label for each sweep key.
_LOAD_LABELS = {
    "concurrency": "concurrency (clients)",
    "rate": "request rate (req/s)",
    "time_scale": "trace time scale",
    "conversations": "concurrent conversations",
}


def load_key(result: dict) -> str:
    """The sweep's key (concurrency, rate, ...) as its points carry it."""
    points = result.get("points") or [{}]
    return next((k for k in points[0] if k in POINT_KEYS), "concurrency")


def draw(results: Sequence[tuple[str, dict]], prefix: Path) -> list[Path]:
    """The three plots of (label, result) pairs, written next to `prefix`; their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths = [Path(f"{prefix}-{name}.png") for name in ("pareto", "cdf", "throughput")]
    for path, drawer in zip(paths, (_pareto, _cdfs, _throughput), strict=True):
        figure = drawer(plt, results, colours)
        figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(figure)
    return paths


def _pareto(plt, results, colours):
    figure, axes = plt.subplots(figsize=(7, 5))
    for (label, result), colour in zip(results, colours, strict=False):
        points = result["points"]
        xy = [
            (p.get("output_tok_s_per_user"), p.get("output_tok_s_per_gpu", p.get("output_tok_s")))
            for p in points
        ]
        axes.scatter([x for x, _ in xy], [y for _, y in xy], color=colour, alpha=0.6, label=label)
        for point, (x, y) in zip(points, xy, strict=True):
            if x is not None and y is not None:
                axes.annotate(
                    point_name(point), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
                )
        front = pareto_front(xy)
        axes.plot(
            [xy[i][0] for i in front], [xy[i][1] for i in front], color=colour, label=f"{label} Pareto front"
        )
    axes.set(
        xlabel="output tok/s per user",
        ylabel="output tok/s per GPU",
        title="Throughput against interactivity",
    )
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return figure


def _cdfs(plt, results, colours):
    figure, (ttft, itl) = plt.subplots(1, 2, figsize=(11, 4.5))
    styles = ("-", "--", ":", "-.")
    for (label, result), colour in zip(results, colours, strict=False):
        for n, point in enumerate(result["points"]):
            for axes, name in ((ttft, "ttft"), (itl, "itl")):
                values = (point.get("cdf_ms") or {}).get(name) or []
                if values:
                    fractions = [i / (len(values) - 1) for i in range(len(values))]
                    axes.plot(
                        values,
                        fractions,
                        color=colour,
                        linestyle=styles[n % len(styles)],
                        label=f"{label} {point_name(point)}",
                    )
    for axes, name in ((ttft, "TTFT"), (itl, "ITL")):
        axes.set(
            xlabel=f"{name} (ms)",
            ylabel="fraction of requests" if name == "TTFT" else "fraction of gaps",
            title=f"{name} CDF",
            ylim=(0, 1.01),
        )
        axes.grid(alpha=0.3)
    ttft.legend(fontsize=7)
    return figure


def _throughput(plt, results, colours):
    figure, (tok_s, ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    key = load_key(results[0][1])
    for (label, result), colour in zip(results, colours, strict=False):
        points = result["points"]
        loads = [p.get(load_key(result)) for p in points]
        tok_s.plot(loads, [p.get("output_tok_s") for p in points], marker="o", color=colour, label=label)
        ttft.plot(
            loads,
            [(p.get("ttft_ms") or {}).get("p50") for p in points],
            marker="o",
            color=colour,
            label=label,
        )
    label = _LOAD_LABELS.get(key, key)
    tok_s.set(xlabel=label, ylabel="output tok/s", title=f"Throughput against {label}")
    ttft.set(xlabel=label, ylabel="TTFT p50 (ms)", title=f"TTFT against {label}")
    for axes in (tok_s, ttft):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    return figure
