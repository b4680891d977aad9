"""What a second thread's per-step work costs a host-bound engine thread on this machine's CPU (the GIL hand-off).

    PYTHONPATH=shared:. python bench/serve/gil_handoff.py [--loop-us 30] [--step-us 1100] [--steps 3000] [--rounds 3] [--cpu N] [--out FILE]

An engine thread runs steps of `--step-us` of Python that drop the GIL every ~20 us (a numpy take, as torch ops
do). Modes: `none` (nothing else), `thread` (an asyncio loop in the main thread, woken by an eventfd each step,
does `--loop-us` of Python: the decode worker's layout), `inline` (the engine thread does that work itself after
each step); `--cpu N` adds `thread` with the process pinned to core N. Mean step (middle 80%) per mode and
round; a table and one JSON line. Session 8: +0.27 ms a step for `thread` on the 2-core dev VM, none on the
H200 host (docs/journal/serving-path-2026-12.md, "The H200 host's noise").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.results_io import emit_json_line


def spin(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def measure(mode: str, args) -> float:
    """Mean step in ms (middle 80% of the steps) for one mode."""
    table, out, rows = np.zeros((512, 64), np.int32), np.zeros((64, 64), np.int32), list(range(64))
    wakeup, done, times = os.eventfd(0, os.EFD_NONBLOCK), threading.Event(), []

    def engine() -> None:
        for _ in range(args.steps):
            started = time.perf_counter()
            for _ in range(max(1, int(args.step_us / 20))):
                spin(20)
                np.take(table, rows, axis=0, out=out)  # drops and re-takes the GIL
            if mode == "inline":
                spin(args.loop_us)
            elif mode == "thread":
                os.eventfd_write(wakeup, 1)
            times.append(time.perf_counter() - started)
        done.set()

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def on_readable() -> None:
            try:
                os.eventfd_read(wakeup)
            except BlockingIOError:
                return
            spin(args.loop_us)

        loop.add_reader(wakeup, on_readable)
        thread = threading.Thread(target=engine)
        thread.start()
        while not done.is_set():
            await asyncio.sleep(0.01)
        thread.join()

    asyncio.run(main())
    os.close(wakeup)
    trimmed = sorted(times)[len(times) // 10: -len(times) // 10]
    return statistics.fmean(trimmed) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop-us", type=float, default=30.0)
    parser.add_argument("--step-us", type=float, default=1100.0)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", type=int, default=None, help="also `thread` pinned to this core")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)  # the services'
    modes = ["none", "thread", "inline"] + (["thread-pinned"] if args.cpu is not None else [])
    results: dict[str, list[float]] = {mode: [] for mode in modes}
    allowed = os.sched_getaffinity(0)
    for _ in range(args.rounds):
        for mode in modes:
            os.sched_setaffinity(0, {args.cpu} if mode == "thread-pinned" else allowed)
            results[mode].append(round(measure(mode.removesuffix("-pinned"), args), 4))
    os.sched_setaffinity(0, allowed)
    print(f"{'mode':14s} {'step ms (median)':>16s}  rounds")
    for mode, values in results.items():
        print(f"{mode:14s} {statistics.median(values):16.3f}  {values}")
    emit_json_line({"bench": "gil_handoff", "loop_us": args.loop_us, "step_us": args.step_us, "cpus": os.cpu_count(),
                    "step_ms": results, "median_ms": {m: statistics.median(v) for m, v in results.items()}}, args.out)


if __name__ == "__main__":
    main()
