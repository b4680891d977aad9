"""The clocks and the fake step of bench/serve/loop_cost.py and bench/kv/write_behind_cost.py: what an engine thread's
steps cost outside `core.step()`, and an accelerator-shaped step (Python holding the GIL, then a wait without it)."""

from __future__ import annotations

import asyncio
import resource
import statistics
import time
from dataclasses import dataclass, field

#: The fake step's host work between two GIL releases (one torch call's worth of Python).
FAKE_OP_S = 10e-6


def host_work(seconds: float) -> None:
    """`seconds` of Python holding the GIL, in slices of FAKE_OP_S each followed by a release (as every torch
    call makes): an accelerator step's host part."""
    end_s = time.perf_counter() + seconds
    while (now_s := time.perf_counter()) < end_s:
        op_end_s = min(now_s + FAKE_OP_S, end_s)
        while time.perf_counter() < op_end_s:
            pass
        time.sleep(0)  # releases the GIL, as a torch call does


@dataclass
class StepClock:
    """Wraps an engine's `step` (instance attribute shadows the method): wall and thread-CPU at each step's
    start and end, and the batch it returned; fires `on_window` on the event loop at two step counts."""

    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    cpu_starts: list[float] = field(default_factory=list)
    cpu_ends: list[float] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    marks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[tuple[float, float]]]] = field(default_factory=dict)
    #: From step `fake.first` on, `fake` stands for the model (None: the real model throughout).
    fake: FakeStep | None = None

    def wrap(self, core) -> None:
        step = core.step

        def timed_step():
            index = len(self.starts)
            mark = self.marks.pop(index, None)
            if mark is not None:  # a window boundary: the loop thread's clock is read there
                mark[0].call_soon_threadsafe(_resolve_with_thread_time, mark[1])
            self.cpu_starts.append(time.thread_time())
            self.starts.append(time.perf_counter())
            outputs = self.fake.step(core, index) if self.fake is not None and index >= self.fake.first else step()
            if self.fake is not None and index == self.fake.first - 1:
                self.fake.template = outputs
            self.ends.append(time.perf_counter())
            self.cpu_ends.append(time.thread_time())
            self.batches.append(len(outputs))
            return outputs

        core.step = timed_step

    def mark(self, loop: asyncio.AbstractEventLoop, step_index: int) -> asyncio.Future[tuple[float, float]]:
        """A future resolved with the loop thread's (user, system) CPU seconds when step `step_index` starts."""
        future = loop.create_future()
        self.marks[step_index] = (loop, future)
        return future

    def window(self, first: int, last: int) -> dict[str, float]:
        """µs per step over steps [first, last): inside step() and outside it (engine thread)."""
        n = last - first
        step_wall = sum(self.ends[k] - self.starts[k] for k in range(first, last))
        step_cpu = sum(self.cpu_ends[k] - self.cpu_starts[k] for k in range(first, last))
        total_wall = self.starts[last] - self.starts[first]
        total_cpu = self.cpu_starts[last] - self.cpu_starts[first]
        walls = [self.ends[k] - self.starts[k] for k in range(first, last)]
        return {
            "step_wall_us": 1e6 * step_wall / n,
            "step_wall_p50_us": 1e6 * statistics.median(walls),
            "step_cpu_us": 1e6 * step_cpu / n,
            "outside_step_wall_us": 1e6 * (total_wall - step_wall) / n,
            "outside_step_cpu_us": 1e6 * (total_cpu - step_cpu) / n,
            "period_us": 1e6 * total_wall / n,
        }


@dataclass
class FakeStep:
    """An accelerator's step as the engine thread lives it: `host_s` of Python (schedule, prepare, launch) in
    slices of FAKE_OP_S, each followed by a GIL release as every torch call makes, then `device_s` waiting with
    the GIL released. Its outputs are the last real step's (one new token per request, fresh objects as a real
    step makes); at step `last` every request ends (length)."""

    host_s: float
    device_s: float
    first: int
    last: int
    template: list = field(default_factory=list)

    def step(self, core, index: int) -> list:
        from deepinfer.engine.outputs import EngineOutput
        from deepinfer.protocol import FinishReason

        host_work(self.host_s)
        time.sleep(self.device_s)
        finish = None
        if index == self.last:
            core.abort_requests([o.request_id for o in self.template])
            finish = FinishReason.LENGTH
        return [EngineOutput(o.request_id, [o.new_token_ids[-1]], None, finish, None, o.num_cached_tokens)
                for o in self.template]


def _resolve_with_thread_time(future: asyncio.Future[tuple[float, float]]) -> None:
    if not future.done():
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        future.set_result((usage.ru_utime, usage.ru_stime))
