"""The worker's per-step path: coroutines run eagerly (a task only when they wait), steps reach the event loop
in order behind one wakeup (an eventfd on Linux), and the load numbers are replaced only when they change."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from deepinfer.engine import Abort, EngineCommand
from deepinfer.tasks import BackgroundTasks
from deepinfer.testing.fake_engine import ScriptedEngine
from deepinfer.worker.eager import run_eagerly
from deepinfer.worker.engine_loop import EngineLoop, StepTimes, StepWakeup

# -- run_eagerly --------------------------------------------------------------------------------------------------


async def test_a_coroutine_that_never_waits_is_done_before_run_eagerly_returns():
    tasks, done = BackgroundTasks("t"), []

    async def publish() -> None:
        done.append("published")

    run_eagerly(tasks, publish())
    assert done == ["published"]
    assert len(tasks) == 0


async def test_a_coroutine_that_waits_becomes_a_held_task_and_finishes():
    tasks, seen = BackgroundTasks("t"), []
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def publish() -> None:
        seen.append("before")
        seen.append(await future)
        await asyncio.sleep(0)  # a bare yield too
        seen.append("after")

    run_eagerly(tasks, publish())
    assert seen == ["before"] and len(tasks) == 1
    for _ in range(3):
        await asyncio.sleep(0)  # the task runs and waits on the future too
    assert seen == ["before"] and len(tasks) == 1
    future.set_result(7)
    assert await tasks.drain(2.0)
    assert seen == ["before", 7, "after"]
    assert tasks.num_failed == 0


async def test_failures_are_counted_and_never_raised(caplog):
    tasks = BackgroundTasks("t")
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def fails_at_once() -> None:
        raise RuntimeError("no connection")

    async def fails_after_waiting() -> None:
        await future
        raise RuntimeError("late")

    run_eagerly(tasks, fails_at_once(), name="first")
    run_eagerly(tasks, fails_after_waiting(), name="second")
    await asyncio.sleep(0)
    future.set_result(None)
    await tasks.drain(2.0)
    assert tasks.num_failed == 2
    assert "first failed: no connection" in caplog.text


async def test_the_awaited_futures_error_reaches_the_coroutine():
    tasks, seen = BackgroundTasks("t"), []
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def handles_it() -> None:
        try:
            await future
        except ValueError as exc:
            seen.append(str(exc))

    run_eagerly(tasks, handles_it())
    await asyncio.sleep(0)
    future.set_exception(ValueError("refused"))
    assert await tasks.drain(2.0)
    assert seen == ["refused"] and tasks.num_failed == 0


async def test_a_drain_past_its_deadline_cancels_the_waiting_coroutine():
    tasks, seen = BackgroundTasks("t"), []

    async def waits_forever() -> None:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    run_eagerly(tasks, waits_forever())
    assert not await tasks.drain(0.05)
    assert seen == ["cancelled"] and len(tasks) == 0


# -- EngineLoop ---------------------------------------------------------------------------------------------------


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_steps_taken_while_the_loop_is_busy_arrive_in_order_behind_one_wakeup():
    loop = asyncio.get_running_loop()
    received = []
    scripted = ScriptedEngine(num_steps=20)
    engine = EngineLoop(scripted, loop, lambda outputs, events, seq: received.append((outputs[0], seq)))
    engine.start()
    deadline = time.monotonic() + 10
    while len(engine._ready) < 20 and time.monotonic() < deadline:  # queued, not only taken (scripted.steps)
        time.sleep(0.01)  # the event loop is busy: the engine thread takes all 20 steps meanwhile
    await wait_for(lambda: len(received) == 20)
    assert [r[0] for r in received] == [f"out-{k}" for k in range(1, 21)]
    # KV events on every second step: seq counts the non-empty batches, in order.
    assert [r[1] for r in received] == [k // 2 for k in range(1, 21)]
    assert engine._wakeup.num_wakes == 1
    await engine.stop()


async def test_each_steps_time_is_observed_by_its_kind():
    """EngineLoop.on_step_time gets every step's kind and wall time; StepTimes counts them by kind (not empty)."""
    from prometheus_client import CollectorRegistry

    class KindedEngine(ScriptedEngine):
        def run_step(self) -> None:
            self.last_step_kind = ("mixed", "decode", "decode", "empty", "prefill")[self.steps % 5]
            if self.last_step_kind == "mixed":
                time.sleep(0.025)  # longer than 8 decode steps take, even with the engine thread preempted

    registry, scripted = CollectorRegistry(), KindedEngine(num_steps=20)
    engine = EngineLoop(scripted, asyncio.get_running_loop(), lambda outputs, events, seq: None)
    engine.on_step_time = StepTimes(registry).observe
    engine.start()
    await wait_for(lambda: scripted.steps == 20)
    await engine.stop()

    def sample(suffix: str, kind: str) -> float | None:
        return registry.get_sample_value(f"deepinfer_worker_engine_step_seconds_{suffix}", {"kind": kind})

    assert {kind: sample("count", kind) for kind in ("decode", "mixed", "prefill")} == {
        "decode": 8.0, "mixed": 4.0, "prefill": 4.0}
    assert sample("count", "empty") is None
    assert sample("sum", "mixed") >= 4 * 0.025 > sample("sum", "decode")


async def test_a_failing_output_handler_does_not_lose_the_next_steps(caplog):
    received = []

    def on_outputs(outputs, events, seq) -> None:
        if outputs[0] == "out-1":
            raise RuntimeError("handler bug")
        received.append(outputs[0])

    engine = EngineLoop(ScriptedEngine(num_steps=3), asyncio.get_running_loop(), on_outputs)
    engine.start()
    await wait_for(lambda: len(received) == 2)
    assert received == ["out-2", "out-3"]
    assert "handler bug" in caplog.text
    await engine.stop()


@pytest.mark.parametrize("changed", [False, True])
async def test_the_load_is_replaced_only_when_a_number_changes(changed):
    scripted = ScriptedEngine(num_steps=0)
    engine = EngineLoop(scripted, asyncio.get_running_loop(), lambda outputs, events, seq: None)
    before = engine.stats
    assert engine.stats == scripted.stats()
    if changed:
        scripted.load = scripted.load._replace(num_waiting=3)
    engine.start()
    await engine.call(Abort([]))  # a command: the load is taken again after it
    assert (engine.stats is before) is not changed
    assert engine.stats == scripted.stats()
    assert engine.stats.num_waiting == (3 if changed else 0)
    await engine.stop()


async def test_commands_queued_together_are_answered_behind_one_wakeup_in_order():
    loop = asyncio.get_running_loop()
    scripted, wakeups, after = ScriptedEngine(num_steps=0), [], []
    engine = EngineLoop(scripted, loop, lambda outputs, events, seq: None)
    engine._loop = SimpleNamespace(create_future=loop.create_future, call_soon_threadsafe=lambda fn, *args: (
        wakeups.append(fn), loop.call_soon_threadsafe(fn, *args)))
    engine.after_command = lambda: after.append(engine.stats.num_waiting)
    batches, settled = [], []
    engine.on_commands = lambda n, wall_s, cpu_s: batches.append((n, wall_s >= 0 and cpu_s >= 0))
    engine.on_settled = settled.append
    ran = []

    @dataclass(frozen=True)
    class Admit(EngineCommand[int]):
        """A command that records its order and sets the waiting count (the load a real admission changes)."""

        k: int

        def apply(self, engine) -> int:
            ran.append(self.k)
            engine.load = engine.load._replace(num_waiting=self.k)
            if self.k == 3:
                raise ValueError("bad request 3")
            return self.k * 10

    calls = [asyncio.ensure_future(engine.call(Admit(k))) for k in range(8)]
    await asyncio.sleep(0)  # all 8 queued before the engine thread starts: it takes them in one drain
    engine.start()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert ran == list(range(8))
    assert [r if isinstance(r, int) else str(r) for r in results] == [0, 10, 20, "bad request 3", 40, 50, 60, 70]
    assert wakeups == [engine._settle]
    assert after == [7]  # the load-change check once, with the load the last command left
    assert batches == [(8, True)] and settled == [8]  # the hooks: one batch of 8 run, 8 answered
    await engine.stop()


# -- KV event batches as wire bytes ---------------------------------------------------------------------------


def test_kv_event_batch_bytes_are_the_models():
    from deepinfer.engine.block_pool import AllCleared, Removed, Stored
    from deepinfer.protocol import KvEvent, KvEventBatch, KvEventKind, KvTier
    from deepinfer.worker.kv_event_wire import encode_kv_event_batch

    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    events = [Stored([a, b], None), Stored([c], b), Removed([a]), Stored([a], None, tier="host"),
              Removed([b], tier="host"), AllCleared()]
    model = KvEventBatch(worker_id="decode-0", seq=7, ts=1733030000.25, epoch="e1", events=[
        KvEvent(event_kind=KvEventKind.STORED, block_hashes=[a, b]),
        KvEvent(event_kind=KvEventKind.STORED, block_hashes=[c], parent_hash=b),
        KvEvent(event_kind=KvEventKind.REMOVED, block_hashes=[a]),
        KvEvent(event_kind=KvEventKind.STORED, block_hashes=[a], tier=KvTier.HOST),
        KvEvent(event_kind=KvEventKind.REMOVED, block_hashes=[b], tier=KvTier.HOST),
        KvEvent(event_kind=KvEventKind.ALL_CLEARED),
    ])
    wire = encode_kv_event_batch("decode-0", 7, events, 1733030000.25, "e1")
    assert wire == model.to_bytes()
    assert KvEventBatch.from_bytes(wire) == model


class _WriteRecorder:
    """A bus that records each publish_now (one socket write) and each fallback publish."""

    def __init__(self, connected: bool = True) -> None:
        self.connected = connected
        self.writes: list[list[tuple[str, bytes]]] = []
        self.published: list[tuple[str, bytes]] = []

    def publish_now(self, messages: list[tuple[str, bytes]]) -> bool:
        if self.connected:
            self.writes.append(list(messages))
        return self.connected

    async def publish(self, subject: str, payload: bytes) -> None:
        self.published.append((subject, payload))


def _runtime(bus: _WriteRecorder):
    from deepinfer.config import CommonSettings, DecodeSettings
    from deepinfer.protocol import WorkerRole
    from deepinfer.telemetry import new_registry
    from deepinfer.worker.runtime import WorkerRuntime

    settings = DecodeSettings(common=CommonSettings(model="tiny"), worker_id="decode-0", internal_port=0,
                              kv_store=False)
    return WorkerRuntime(settings, WorkerRole.DECODE, bus, new_registry())  # type: ignore[arg-type]


@pytest.mark.parametrize("connected", [True, False])
async def test_a_steps_token_batches_and_kv_event_batch_go_in_one_write(connected):
    from deepinfer.engine.block_pool import Stored
    from deepinfer.engine.outputs import EngineOutput
    from deepinfer.protocol import KvEventBatch

    bus = _WriteRecorder(connected)
    runtime = _runtime(bus)
    tokens = [("tokens.gw-a", b"batch a"), ("tokens.gw-b", b"batch b")]
    runtime.on_outputs = lambda outputs: runtime.outbox.publish(tokens, "token-batch")
    output = EngineOutput("r0", [7], None, None, None, 0)

    runtime._on_step([output], [Stored([b"h" * 16], None)], 5)  # a step with KV events: one write of all three
    runtime._on_step([output], [], 5)  # without: the token batches alone, at once
    runtime._on_step([], [Stored([b"g" * 16], None)], 6)  # events alone
    await asyncio.sleep(0)

    sent = bus.writes if connected else [[m] for m in bus.published]  # not connected: one publish each
    flat = [m for write in sent for m in write]
    assert [subject for subject, _ in flat] == ["tokens.gw-a", "tokens.gw-b", runtime._kv_events_subject,
                                                "tokens.gw-a", "tokens.gw-b", runtime._kv_events_subject]
    assert [KvEventBatch.from_bytes(flat[i][1]).seq for i in (2, 5)] == [5, 6]
    if connected:
        assert [len(write) for write in bus.writes] == [3, 2, 1]
    assert runtime.outbox.release() == []  # nothing left held


async def test_a_failing_output_handler_still_publishes_the_steps_kv_event_batch():
    from deepinfer.engine.block_pool import Stored
    from deepinfer.engine.outputs import EngineOutput
    from deepinfer.protocol import KvEventBatch

    bus = _WriteRecorder()
    runtime = _runtime(bus)

    def failing(outputs):
        runtime.outbox.publish([("tokens.gw-a", b"batch a")], "token-batch")
        raise RuntimeError("handler bug")

    runtime.on_outputs = failing
    with pytest.raises(RuntimeError, match="handler bug"):  # EngineLoop._deliver logs it and goes on
        runtime._on_step([EngineOutput("r0", [7], None, None, None, 0)], [Stored([b"h" * 16], None)], 9)
    (write,) = bus.writes
    assert [subject for subject, _ in write] == ["tokens.gw-a", runtime._kv_events_subject]
    assert KvEventBatch.from_bytes(write[1][1]).seq == 9  # no gap in the router's sequence


# -- StepWakeup ---------------------------------------------------------------------------------------------------

CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("caller")



@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="eventfd is Linux-only")
async def test_wakeups_from_a_thread_run_the_callback_on_the_loop_through_an_eventfd():
    loop, ran, seen = asyncio.get_running_loop(), [], []
    wakeup = StepWakeup(loop, lambda: (ran.append(threading.get_ident()), seen.append(CALLER.get(None))))
    CALLER.set("the caller's span")
    wakeup.start()
    assert wakeup._fd >= 0
    thread = threading.Thread(target=lambda: [wakeup.wake() for _ in range(3)])
    thread.start()
    thread.join()
    await wait_for(lambda: ran)
    await asyncio.sleep(0.05)
    assert ran == [threading.get_ident()]  # three writes before the loop looked: one read, one callback
    assert seen == [None]  # the context start() ran in does not reach the callback (no caller's trace)
    wakeup.wake()
    await wait_for(lambda: len(ran) == 2)
    fd = wakeup._fd
    wakeup.close()
    with pytest.raises(OSError):
        os.fstat(fd)


async def test_without_add_reader_the_wakeup_is_call_soon_threadsafe():
    loop, ran = asyncio.get_running_loop(), []

    def refuse(fd, callback):
        raise NotImplementedError

    wakeup = StepWakeup(SimpleNamespace(add_reader=refuse, call_soon_threadsafe=loop.call_soon_threadsafe),
                        lambda: ran.append("ran"))
    wakeup.start()
    assert wakeup._fd < 0
    threading.Thread(target=wakeup.wake).start()
    await wait_for(lambda: ran == ["ran"])
    wakeup.close()
