"""Plays a sweep point's plan (deepinfer.bench.load) in this process or dealt over several, and checks that the
load generator itself was not the bottleneck.

A generator that cannot keep up reports the server slower than it is: an open loop sends late (its arrivals
bunch up behind the client), a closed loop's clients wait on their own event loop rather than on the server.
Each process therefore measures

- its CPU time over the point's wall time (`cpu_share`: near 1.0, the process had a core to itself and wanted
  more),
- its event loop's lag: a watcher asks to wake every WATCH_INTERVAL_S and records how late it woke,
- for an open loop, every request's send lag: when it went less when it was meant to go,

and `generator_report` flags the point when any of them passes its limit. `--processes N` deals the plan over N
processes (spawned, each with its own event loop and connections) that start together on the machine's
monotonic clock; their records are merged as if one generator had sent them.

    parent:  spawn N ──► barrier (all imported) ──► start_s = now + START_LEAD_S ──► go ──► gather shares
    child i:                 ready ──► wait go ──► play share i from start_s ──► (records, cpu_s, lags)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import queue
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import httpx

from deepinfer.bench.load import OnDone, Plan
from deepinfer.bench.metrics import RequestRecord, distribution_ms

#: How often the event-loop watcher asks to wake.
WATCH_INTERVAL_S = 0.01
#: A process busier than this fraction of one core may be what limits the load.
CPU_SHARE_LIMIT = 0.8
#: A p99 send lag (open loop) or event-loop lag above this means requests went out late.
LAG_LIMIT_MS = 10.0
#: Between the go signal and the first send, so every spawned process is waiting when the clock starts.
START_LEAD_S = 0.2


@dataclass
class Share:
    """What one process measured while playing its share of a point."""

    records: list[RequestRecord]
    cpu_s: float
    wall_s: float
    loop_lag_s: list[float] = field(default_factory=list)


@dataclass
class Outcome:
    """A point's records (every share's), its wall time (start to the last answer's end) and the shares."""

    records: list[RequestRecord]
    wall_s: float
    shares: list[Share]


class Progress:
    """One line on `stream`: requests done of the total, failures, seconds. Redrawn in place on a terminal
    (at most every 0.2 s), else a new line every 5 s; `finish` ends it."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label, self.total, self.stream = label, total, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started_s = self.last_s = time.monotonic()
        self.done = self.failed = 0

    def line(self) -> str:
        return (
            f"[{self.label}] {self.done}/{self.total} requests, {self.failed} failed, "
            f"{time.monotonic() - self.started_s:.1f} s"
        )

    def update(self, done: int, failed: int) -> None:
        self.done, self.failed = done, failed
        now_s = time.monotonic()
        if now_s - self.last_s >= (0.2 if self.tty else 5.0):
            self.last_s = now_s
            self.stream.write(("\r" if self.tty else "") + self.line() + ("" if self.tty else "\n"))
            self.stream.flush()

    def count(self, record: RequestRecord) -> None:
        """An `OnDone` for a plan played in this process."""
        self.update(self.done + 1, self.failed + (record.error is not None))

    def finish(self) -> None:
        self.stream.write(("\r" if self.tty else "") + self.line() + "\n")
        self.stream.flush()


def execute(
    plan: Plan,
    base_url: str,
    num_processes: int = 1,
    progress: Progress | None = None,
    timeout_s: float = 600.0,
) -> Outcome:
    """Play `plan` here (one process) or dealt over `num_processes` spawned ones."""
    progress = progress or Progress("bench", plan.num_requests)
    if num_processes <= 1:
        start_s = time.monotonic()
        shares = [asyncio.run(play_share(plan, base_url, start_s, timeout_s, progress.count))]
    else:
        shares, start_s = _execute_in_processes(plan, base_url, num_processes, progress, timeout_s)
    progress.finish()
    records = [r for share in shares for r in share.records]
    end_s = max((r.end_s for r in records), default=start_s)
    return Outcome(records, max(end_s - start_s, 0.0), shares)


async def play_share(plan: Plan, base_url: str, start_s: float, timeout_s: float, on_done: OnDone) -> Share:
    """One process's share, with its CPU time and its event loop's lag measured alongside."""
    # open-loop and conversation loads hold a connection per request in flight: no pool limit
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    lags: list[float] = []
    watcher = asyncio.create_task(_watch_loop(lags))
    cpu_s, wall_s = time.process_time(), time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            records = await plan.run(client, base_url, start_s, on_done)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return Share(records, time.process_time() - cpu_s, time.monotonic() - wall_s, lags)


async def _watch_loop(lags: list[float]) -> None:
    while True:
        asked_s = time.monotonic()
        await asyncio.sleep(WATCH_INTERVAL_S)
        lags.append(max(0.0, time.monotonic() - asked_s - WATCH_INTERVAL_S))


def _execute_in_processes(
    plan: Plan, base_url: str, num_processes: int, progress: Progress, timeout_s: float
) -> tuple[list[Share], float]:
    context = multiprocessing.get_context("spawn")  # no forked event loop or connection pool
    parts = plan.split(num_processes)
    ready, go = context.Barrier(len(parts) + 1), context.Event()
    start, done, failed = context.Value("d", 0.0), context.Value("i", 0), context.Value("i", 0)
    results = context.Queue()
    processes = [
        context.Process(
            target=_child,
            daemon=True,
            name=f"deepinfer-bench-{i}",
            args=(i, part, base_url, timeout_s, ready, go, start, done, failed, results),
        )
        for i, part in enumerate(parts)
    ]
    for process in processes:
        process.start()
    try:
        ready.wait(timeout=120)
        start.value = time.monotonic() + START_LEAD_S
        go.set()
        shares: dict[int, Share] = {}
        while len(shares) < len(parts):
            try:
                index, share = results.get(timeout=0.2)
            except queue.Empty:
                progress.update(done.value, failed.value)
                if any(not p.is_alive() and i not in shares for i, p in enumerate(processes)):
                    raise RuntimeError("a load generator process died") from None
                continue
            if isinstance(share, str):
                raise RuntimeError(f"load generator process {index}: {share}")
            shares[index] = share
        progress.update(done.value, failed.value)
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    return [shares[i] for i in range(len(parts))], start.value


def _child(index, part, base_url, timeout_s, ready, go, start, done, failed, results) -> None:
    """A spawned process: wait for the others, play its share from the common start, send back what it saw."""

    def on_done(record: RequestRecord) -> None:
        with done.get_lock():
            done.value += 1
        if record.error is not None:
            with failed.get_lock():
                failed.value += 1

    ready.wait()
    go.wait()
    try:
        share = asyncio.run(play_share(part, base_url, start.value, timeout_s, on_done))
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        results.put((index, f"{type(exc).__name__}: {exc}"))
        return
    results.put((index, share))


def generator_report(outcome: Outcome) -> dict:
    """The point's `generator` figures: processes, the busiest one's CPU share, event-loop lag, send lag (open
    loop), and `bottleneck` with the reasons when a limit was passed (module docstring)."""
    cpu_share = max((s.cpu_s / s.wall_s for s in outcome.shares if s.wall_s > 0), default=math.nan)
    loop_lag = distribution_ms([lag for s in outcome.shares for lag in s.loop_lag_s])
    send_lags = [r.sent_s - r.scheduled_s for r in outcome.records if not math.isnan(r.scheduled_s)]
    report = {"processes": len(outcome.shares), "cpu_share": round(cpu_share, 3), "loop_lag_ms": loop_lag}
    reasons = []
    if cpu_share > CPU_SHARE_LIMIT:
        reasons.append(f"a generator process used {cpu_share:.0%} of a core (limit {CPU_SHARE_LIMIT:.0%})")
    if loop_lag["p99"] > LAG_LIMIT_MS:
        reasons.append(f"event-loop lag p99 {loop_lag['p99']:.1f} ms (limit {LAG_LIMIT_MS:g} ms)")
    if send_lags:
        report["send_lag_ms"] = distribution_ms(send_lags) | {"max": round(1e3 * max(send_lags), 3)}
        if report["send_lag_ms"]["p99"] > LAG_LIMIT_MS:
            reasons.append(f"send lag p99 {report['send_lag_ms']['p99']:.1f} ms (limit {LAG_LIMIT_MS:g} ms)")
    return report | {"bottleneck": bool(reasons), "reasons": reasons}
