"""What a hop and a publish's trace context cost a service's event loop with the exporter none (the default).

    PYTHONPATH=shared:. python bench/serve/hop_cost.py [--n 20000]

µs per call, best of 5 runs of N calls, on the code under PYTHONPATH (run it once per checkout to compare): a
`Hops.span` block and a `Hops.record` (each one histogram observation, and nothing else once the exporter is
none), the histogram observation alone, `outgoing_headers` of a publish with no trace current, and a received
message without headers through `dispatch` (its trace context; the handler is an empty coroutine). Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import Callable

from deepinfer.bus.envelope import dispatch, outgoing_headers
from deepinfer.config import CommonSettings
from deepinfer.telemetry import new_registry, setup_tracer_provider
from deepinfer.telemetry.hops import Hops


def best_us(fn: Callable[[], object], n: int) -> float:
    """The best of 5 runs of `n` calls, µs per call."""
    fn()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - started) / n * 1e6)
    return round(best, 2)


class _Msg:
    subject, data, reply, headers = "s", b"", "", None


async def _dispatch_us(n: int) -> float:
    async def handler(message: object, msg: object) -> None:
        return None

    msg, log = _Msg(), logging.getLogger("hop_cost")
    started = time.perf_counter()
    for _ in range(n):
        await dispatch(handler, msg, None, log)
    return round((time.perf_counter() - started) / n * 1e6, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    args = parser.parse_args()
    hops = Hops(setup_tracer_provider(CommonSettings(), "gateway").get_tracer("t"), new_registry(False), "gateway")
    child = hops.seconds.labels("route")

    def span() -> None:
        with hops.span("route"):
            pass

    result = {
        "bench": "hop_cost",
        "hop_span_us": best_us(span, args.n),
        "hop_record_us": best_us(lambda: hops.record("queue", 1.0, 1.001), args.n),
        "histogram_observe_us": best_us(lambda: child.observe(0.001), args.n),
        "outgoing_headers_us": best_us(lambda: outgoing_headers(None), args.n),
        "dispatch_no_headers_us": min(asyncio.run(_dispatch_us(args.n)) for _ in range(3)),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
