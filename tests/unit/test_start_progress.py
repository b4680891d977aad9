"""An engine's start reported phase by phase: the engine marks each phase, a worker logs them while it loads."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from deepinfer.engine import Engine, EngineArgs, StartPhase, StartProgress
from deepinfer.worker.runtime import report_slow_start


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_phases_last_until_the_next_begins_and_the_running_one_is_marked():
    clock = FakeClock()
    progress = StartProgress(clock=clock)
    assert progress.current() is None and progress.describe() == "not begun"
    progress.begin("preparing the model")
    clock.now_s += 0.5
    progress.begin("loading weights")
    clock.now_s += 3.0
    assert progress.current() == StartPhase("loading weights", 100.5)
    assert progress.durations() == [("preparing the model", 0.5), ("loading weights", 3.0)]
    assert progress.describe() == "preparing the model 0.5 s, loading weights 3.0 s (now)"
    assert progress.elapsed_s() == 3.5
    progress.finish()
    clock.now_s += 10.0  # nothing runs after finish(): no phase grows
    assert progress.current() is None
    assert progress.describe() == "preparing the model 0.5 s, loading weights 3.0 s"
    assert progress.elapsed_s() == 3.5


def test_a_cpu_engine_reports_each_phase_of_its_start_in_order(tiny_dir):
    heard: list[str] = []
    progress = StartProgress(on_phase=lambda phase: heard.append(phase.name))
    Engine(EngineArgs(model=str(tiny_dir), block_size=4, progress=False, max_model_len=32), progress)
    # No CUDA graphs and no warm-up on a CPU: those phases are a GPU's.
    assert heard == ["preparing the model", "loading weights", "planning the KV cache", "allocating the KV cache",
                     "building the runner", "allocating the host KV tier"]
    assert [name for name, _ in progress.durations()] == heard
    assert progress.current() is None and progress.finished_s is not None


async def test_a_slow_start_logs_the_phase_it_is_in_until_cancelled(caplog):
    clock = FakeClock()
    progress = StartProgress(clock=clock)
    progress.begin("preparing the model")
    clock.now_s += 0.2
    progress.begin("loading weights")
    clock.now_s += 6.0
    caplog.set_level(logging.INFO, logger="deepinfer.worker.runtime")
    reporter = asyncio.create_task(report_slow_start(progress, interval_s=0.001))
    while len(caplog.records) < 2:
        await asyncio.sleep(0.001)
    reporter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reporter
    assert [r.getMessage() for r in caplog.records[:2]] == [
        "engine starting for 6 s: preparing the model 0.2 s, loading weights 6.0 s (now)"] * 2
