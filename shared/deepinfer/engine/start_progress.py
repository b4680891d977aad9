"""An engine's start, phase by phase: what it is doing now and how long each phase took.

    progress = StartProgress()
    core = EngineCore(args, progress)      # on its thread: begin("loading weights"), begin("warming up"), ...
    progress.describe()                    # from any thread: "preparing the model 0.1 s, loading weights 3.2 s (now)"

A worker logs `describe()` every few seconds while its engine loads (deepinfer.worker.runtime), so a slow start
says which phase it is in; the engine only marks where each phase begins.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StartPhase:
    """One phase of an engine's start: its name ("loading weights") and when it began (the progress's clock)."""

    name: str
    started_s: float


class StartProgress:
    """The phases of one engine's start, in order; a phase lasts until the next one begins or `finish()`.

    Lifecycle: the thread building the engine calls `begin(name)` as each phase starts, then `finish()`; any
    other thread reads `current()`, `durations()`, `describe()` meanwhile (the phase list only grows, by one
    append, and a reader takes its own copy). `on_phase`, when given, runs on the building thread at each
    `begin`. `clock` is time.monotonic unless a test passes its own.
    """

    def __init__(
        self,
        on_phase: Callable[[StartPhase], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.started_s = clock()
        self.finished_s: float | None = None
        self.phases: list[StartPhase] = []
        self._on_phase = on_phase

    def begin(self, name: str) -> None:
        """The phase `name` starts now (the previous one ends)."""
        phase = StartPhase(name, self.clock())
        self.phases.append(phase)
        if self._on_phase is not None:
            self._on_phase(phase)

    def finish(self) -> None:
        """The start is over (the last phase ends)."""
        self.finished_s = self.clock()

    def current(self) -> StartPhase | None:
        """The phase running now (None before the first and after `finish()`)."""
        phases = self.phases[-1:]
        return phases[0] if phases and self.finished_s is None else None

    def elapsed_s(self) -> float:
        """Seconds since the start began, up to `finish()`."""
        end_s = self.finished_s if self.finished_s is not None else self.clock()
        return end_s - self.started_s

    def durations(self) -> list[tuple[str, float]]:
        """(name, seconds) of every phase begun so far; the running one's seconds so far."""
        phases = list(self.phases)
        if not phases:
            return []
        end_s = self.finished_s if self.finished_s is not None else self.clock()
        ends = [phase.started_s for phase in phases[1:]] + [end_s]
        return [(phase.name, end - phase.started_s) for phase, end in zip(phases, ends, strict=True)]

    def describe(self) -> str:
        """"preparing the model 0.1 s, loading weights 3.2 s (now)": every phase so far, the running one marked."""
        running = self.current() is not None
        parts = [f"{name} {seconds:.1f} s" for name, seconds in self.durations()]
        if running and parts:
            parts[-1] += " (now)"
        return ", ".join(parts) or "not begun"
