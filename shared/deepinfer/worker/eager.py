"""`run_eagerly`: start a coroutine now, on the caller's turn of the event loop, and make a task of it only if
it has to wait (what `asyncio.eager_task_factory` does from Python 3.12, for one coroutine at a time).

A worker publishes its token batches and KV events from a callback that runs once per engine step. A NATS
publish almost never waits (nats-py appends to its pending buffer and wakes its flusher), so a task per publish
costs a Task and one more turn of the loop (another epoll call, another GIL handoff with the engine thread)
for nothing:

    run_eagerly(tasks, bus.publish(subject, payload))   # done here, or held by `tasks` if it suspended
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from deepinfer.tasks import BackgroundTasks

log = logging.getLogger(__name__)


def run_eagerly(tasks: BackgroundTasks, coro: Coroutine[Any, Any, Any], name: str | None = None) -> None:
    """Run `coro` up to its first suspension now; the rest (if any) runs as a task held by `tasks`. A failure
    is logged and counted like a background task's, never raised to the caller."""
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return
    except Exception as exc:
        tasks.num_failed += 1
        log.error("%s: %s failed: %s", tasks.owner, name or coro.__qualname__, exc, exc_info=exc)
        return
    tasks.spawn(_resume(coro, waiting_on), name=name)


async def _resume(coro: Coroutine[Any, Any, Any], waiting_on: Any) -> Any:
    """Drive a started coroutine as a Task would: wait for the future it yielded (None: a bare yield), then
    resume it (it reads the future's result or error itself); a cancellation of this task is thrown into it."""
    while True:
        cancelled: asyncio.CancelledError | None = None
        try:
            if waiting_on is None:
                await asyncio.sleep(0)
            else:
                waiting_on._asyncio_future_blocking = False  # taken, as Task.__step takes it
                await waiting_on
        except asyncio.CancelledError as exc:
            cancelled = exc
        except Exception:  # noqa: S110 - the coroutine gets it from the future when resumed
            pass
        try:
            waiting_on = coro.throw(cancelled) if cancelled is not None else coro.send(None)
        except StopIteration as stop:
            return stop.value
