"""BackgroundTasks: held until done, failures logged at once, drain waits (also for tasks spawned meanwhile)
and cancels what is left at the deadline."""

from __future__ import annotations

import asyncio
import logging

import pytest

from deepinfer.tasks import BackgroundTasks


async def test_drain_waits_for_every_task_including_those_spawned_while_draining():
    tasks = BackgroundTasks("t")
    done: list[str] = []

    async def publish(name: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        done.append(name)

    async def publish_then_spawn() -> None:
        await asyncio.sleep(0.01)
        tasks.spawn(publish("spawned", 0.02))
        done.append("first")

    tasks.spawn(publish_then_spawn())
    tasks.spawn(publish("second", 0.02))
    assert len(tasks) == 2
    assert await tasks.drain(timeout_s=2.0) is True
    assert sorted(done) == ["first", "second", "spawned"]
    assert len(tasks) == 0


async def test_drain_cancels_what_is_left_at_the_deadline(caplog: pytest.LogCaptureFixture):
    tasks = BackgroundTasks("worker-x")
    cancelled = asyncio.Event()

    async def hang() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    tasks.spawn(hang(), name="hang")
    loop = asyncio.get_running_loop()
    started_s = loop.time()
    with caplog.at_level(logging.WARNING, logger="deepinfer.tasks"):
        assert await tasks.drain(timeout_s=0.1) is False
    assert 0.1 <= loop.time() - started_s < 10.0  # at the deadline, not when the task's 60 s sleep ends
    assert cancelled.is_set() and len(tasks) == 0
    assert "worker-x: 1 background task(s) cancelled" in caplog.text
    assert tasks.num_failed == 0  # a cancelled task is not a failure


async def test_a_failure_is_logged_at_once_with_the_task_name_and_never_raised(caplog):
    tasks = BackgroundTasks("gateway")

    async def fail() -> None:
        raise RuntimeError("nats went away")

    with caplog.at_level(logging.ERROR, logger="deepinfer.tasks"):
        task = tasks.spawn(fail(), name="cancel-req-1")
        await asyncio.sleep(0.01)  # no drain: the done callback logs it
    assert task.done() and tasks.num_failed == 1 and len(tasks) == 0
    assert "gateway: background task cancel-req-1 failed: nats went away" in caplog.text
    assert await tasks.drain(timeout_s=0.1) is True  # the failure does not surface here either


async def test_a_spawned_task_is_held_until_it_ends():
    tasks = BackgroundTasks("t")
    release = asyncio.Event()

    async def wait() -> str:
        await release.wait()
        return "ok"

    task = tasks.spawn(wait())
    del task  # only the helper holds it now
    await asyncio.sleep(0)
    assert len(tasks) == 1
    release.set()
    assert await tasks.drain(1.0)
