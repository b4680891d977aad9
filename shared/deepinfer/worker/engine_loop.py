"""The engine on its own thread, so GPU/CPU work never blocks the service's event loop.

    event loop                                   engine thread
    ----------                                   -------------
    await loop.call(command) ── command queue ──► between steps: command.apply(engine) → future result
    on_outputs(outputs, kv_events, seq) ◄─ one wakeup ─ engine.step(): schedule → execute → update

Commands (`deepinfer.engine`'s `EngineCommand`s, and `CutKvSnapshot` of this module) run between steps, in order,
so scheduler state and KV tensors are only ever touched by this thread.
KV events are numbered here too (`seq` +1 per non-empty batch), so a snapshot cut by `cut_kv_snapshot` on this
thread names exactly the events it includes.

What this thread does besides `core.step()` is in series with the device, so it is kept to a few µs a step:
commands are drained only when one is queued, the load numbers (`stats`, a named tuple) are replaced only when
they change, and steps wait in a queue behind one wakeup (`StepWakeup`):
while the event loop has not taken them yet, further steps join the queue without waking it again (each wakeup is
a syscall here and a GIL handoff there).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from deepinfer.engine import Engine, EngineCommand, EngineOutput, EngineStats, KvCacheEvent
from deepinfer.telemetry.hops import HOP_BUCKETS_S
from deepinfer.telemetry.metrics import histogram

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest the idle engine thread sleeps before checking for a stop request.
IDLE_WAIT_S = 0.1


@dataclass(frozen=True, slots=True)
class CutKvSnapshot:
    """(seq, every cached block hash, every host-tier block hash), consistent with the KV event stream: the events
    not taken yet are dispatched first, so the snapshot includes exactly the batches up to seq."""


Command = EngineCommand[Any] | CutKvSnapshot


class EngineLoop:
    """Runs `Engine.step()` continuously on a thread; commands and outputs cross to the event loop."""

    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[EngineOutput], list[KvCacheEvent], int], None],
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._commands: queue.SimpleQueue[tuple[Command, asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopping = False
        self.num_steps = 0
        #: time.monotonic() when the step now running began; None between steps (read by the health check).
        self.step_started_s: float | None = None
        #: Seq of the last KV event batch handed to on_outputs (engine thread only).
        self.kv_events_seq = 0
        self.error: BaseException | None = None
        #: Load numbers as of the last step or command: replaced by the engine thread when they change (never
        #: mutated), so heartbeats read them without waiting for a long step (a big prefill can take seconds on a
        #: CPU) and a reader sees a change as a new object.
        self.stats: EngineStats = engine.stats()
        #: Steps whose outputs the event loop has not taken yet, and whether a wakeup for them is scheduled.
        self._ready: deque[tuple[list[EngineOutput], list[KvCacheEvent], int]] = deque()
        self._wakeup_scheduled = False
        self._wakeup = StepWakeup(loop, self._deliver)
        #: Called on the event loop after each command's result is set: a command (an admission, an abort) may
        #: change the load with no step after it (the worker's load-change heartbeat check).
        self.after_command: Callable[[], None] | None = None
        #: Called on the engine thread after each step with (`Engine.last_step_kind`, the step's seconds).
        self.on_step_time: Callable[[str, float], None] | None = None
        #: Called on the engine thread after each batch of commands with (how many ran, their wall seconds, this
        #: thread's CPU seconds): time in series with the device that no step accounts for (bench probes).
        self.on_commands: Callable[[int, float, float], None] | None = None
        #: Called on the event loop after a batch of commands was answered, with how many (in the order they ran).
        self.on_settled: Callable[[int], None] | None = None

    def start(self) -> None:
        """Start the engine thread (call on the event loop)."""
        self._wakeup.start()
        self._thread.start()

    async def call(self, command: EngineCommand[T]) -> T:
        """Apply a command on the engine thread between steps and return its result (or raise its error)."""
        if self._stopping or self.error is not None:
            raise RuntimeError("engine loop is not running")
        future: asyncio.Future[T] = self._loop.create_future()
        self._commands.put((command, future))
        return await future

    async def cut_kv_snapshot(self) -> tuple[int, list[bytes], list[bytes]]:
        """A snapshot of the prefix caches at a KV event seq (`CutKvSnapshot`), cut on the engine thread."""
        return await self.call(CutKvSnapshot())  # type: ignore[arg-type]

    async def stop(self) -> None:
        """Stop after the current step; waits for the thread."""
        self._stopping = True
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)
        self._deliver()  # steps queued behind a wakeup that was not read yet
        self._wakeup.close()

    @property
    def stopping(self) -> bool:
        """True once stop() was called."""
        return self._stopping

    @property
    def alive(self) -> bool:
        """True while the thread runs and has not failed."""
        return self._thread.is_alive() and self.error is None

    def _run(self) -> None:
        engine, commands = self.engine, self._commands
        try:
            engine.bind_thread()
            while not self._stopping:
                idle = not engine.has_unfinished_requests()
                if idle or not commands.empty():
                    self._run_commands(block=idle)
                if self._stopping or not engine.has_unfinished_requests():
                    continue
                self.step_started_s = started_s = time.monotonic()
                outputs = engine.step()
                self.step_started_s = None
                if self.on_step_time is not None:
                    self.on_step_time(engine.last_step_kind, time.monotonic() - started_s)
                events = engine.take_kv_events()
                self.num_steps += 1
                self._update_load()
                if outputs or events:
                    self._dispatch(outputs, events)
        except BaseException as exc:  # a failed step leaves the engine unusable: report it, never hang callers
            log.exception("engine thread failed")
            self.error = exc
            self._fail_pending(exc)

    def _apply(self, command: Command) -> Any:
        """One command, on this thread."""
        if isinstance(command, CutKvSnapshot):
            events = self.engine.take_kv_events()
            if events:
                self._dispatch([], events)
            cached, host = self.engine.kv_snapshot()
            return self.kv_events_seq, cached, host
        return command.apply(self.engine)

    def _update_load(self) -> None:
        stats = self.engine.stats()
        if stats != self.stats:
            self.stats = stats

    def _dispatch(self, outputs: list[EngineOutput], events: list[KvCacheEvent]) -> None:
        """Queue one step for the event loop; wake it only if no wakeup is scheduled already. (The flag is
        cleared on the loop before it empties the queue, so a step queued meanwhile is taken or wakes it.)"""
        if events:
            self.kv_events_seq += 1
        self._ready.append((outputs, events, self.kv_events_seq))
        if not self._wakeup_scheduled:
            self._wakeup_scheduled = True
            self._wakeup.wake()

    def _deliver(self) -> None:
        """On the event loop: hand every queued step to on_outputs, in step order."""
        self._wakeup_scheduled = False
        ready = self._ready
        while ready:
            outputs, events, seq = ready.popleft()
            try:
                self._on_outputs(outputs, events, seq)
            except Exception:  # as a failed callback of its own would be: logged, the next steps still go
                log.exception("handling the outputs of an engine step failed")

    def _run_commands(self, block: bool) -> None:
        """Run every queued command (those queued meanwhile too), then hand all their outcomes to the event loop
        in one wakeup: a burst of admissions costs one self-pipe write and one GIL handoff, not one each (each
        handoff let the loop run until its next syscall or the switch interval, with the engine waiting)."""
        try:
            item = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        on_commands = self.on_commands
        if on_commands is not None:
            started_s, started_cpu_s = time.perf_counter(), time.thread_time()
        settled: list[tuple[Callable[[asyncio.Future[Any], Any], None], asyncio.Future[Any], Any]] = []
        try:
            while item is not None:
                command, future = item
                try:
                    settled.append((_set_result, future, self._apply(command)))
                except Exception as exc:
                    settled.append((_set_exception, future, exc))
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    break
        finally:  # even past a fatal error: the commands that ran are answered
            self._update_load()  # the callers resume with the load their commands made
            if on_commands is not None:
                on_commands(len(settled), time.perf_counter() - started_s, time.thread_time() - started_cpu_s)
            if settled:
                self._loop.call_soon_threadsafe(self._settle, settled)

    def _settle(self, settled: list[tuple[Callable[[asyncio.Future[Any], Any], None], asyncio.Future[Any],
                                          Any]]) -> None:
        for settle, future, outcome in settled:
            settle(future, outcome)
        if self.on_settled is not None:
            self.on_settled(len(settled))
        if self.after_command is not None:
            self.after_command()

    def _fail_pending(self, exc: BaseException) -> None:
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._loop.call_soon_threadsafe(_set_exception, item[1], RuntimeError(f"engine failed: {exc}"))


class StepTimes:
    """`deepinfer_worker_engine_step_seconds{kind}`: each engine step's wall time by kind (decode, mixed, prefill;
    `SchedulerOutput.kind`), an `EngineLoop.on_step_time`. With async scheduling a step call's time is mostly its
    wait for the step launched before it, so that step's kind labels it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = histogram(registry, "worker_engine_step_seconds", "Wall time of an engine step, by kind: "
                                 "decode (every request one token), mixed (prompt and decode rows), prefill.",
                                 ["kind"], buckets=HOP_BUCKETS_S)
        self._by_kind = {kind: self.seconds.labels(kind) for kind in ("decode", "mixed", "prefill")}

    def observe(self, kind: str, seconds: float) -> None:
        """One step (an empty one is not counted)."""
        child = self._by_kind.get(kind)
        if child is not None:
            child.observe(seconds)


class StepWakeup:
    """Wakes the event loop from the engine thread to run `callback` there. On Linux an eventfd the loop watches:
    one write here and one read there per wakeup, where `call_soon_threadsafe` costs a Handle and a self-pipe
    write here and, there, two `recv`s (the second raising BlockingIOError). Elsewhere `call_soon_threadsafe`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self._loop = loop
        self._callback = callback
        self._fd = -1
        #: Wakeups sent (engine thread).
        self.num_wakes = 0

    def start(self) -> None:
        """Watch the eventfd (on the event loop; a loop without add_reader, or no eventfd: the self-pipe)."""
        if not hasattr(os, "eventfd"):
            return
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:  # in an empty context, as a callback from the engine thread ran: no caller's trace leaks into it
            contextvars.Context().run(self._loop.add_reader, fd, self._on_readable)
        except NotImplementedError:  # e.g. the proactor loop on Windows
            os.close(fd)
            return
        self._fd = fd

    def wake(self) -> None:
        """From the engine thread: run the callback on the loop soon."""
        self.num_wakes += 1
        if self._fd < 0:
            self._loop.call_soon_threadsafe(self._callback)
            return
        os.eventfd_write(self._fd, 1)  # the fd is closed only once the engine thread has ended

    def _on_readable(self) -> None:
        try:  # noqa: SIM105 - not contextlib.suppress: an object and two calls, once per step
            os.eventfd_read(self._fd)
        except BlockingIOError:  # a spurious readiness: nothing to read, nothing lost
            pass
        self._callback()

    def close(self) -> None:
        """Stop watching and close the eventfd (on the event loop, the engine thread stopped)."""
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
