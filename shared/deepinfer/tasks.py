"""`BackgroundTasks`: work a service starts and does not await at once (publishes, aborts, lease ends).

    tasks = BackgroundTasks("decode")
    tasks.spawn(bus.publish(subject, batch))      # returns at once; a reference is kept until it ends
    ...
    await tasks.drain(timeout_s=5.0)              # on stop: wait for all (and those they spawn), then cancel

A bare `asyncio.create_task` can be collected mid-flight, its failure goes unseen until garbage collection,
and on a graceful stop the last token batch, Release or KV-event publish is lost. Here every task is held
until it ends, a failure is logged at once with the task's name, and `drain` awaits them with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class BackgroundTasks:
    """A set of running tasks owned by one component; see the module docstring."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self.num_failed = 0

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run `coro` as a task held until it ends; its failure is logged (never raised to the caller)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no task is left (tasks spawned meanwhile included); at the deadline cancel the rest.

        Returns True when every task ended on its own.
        """
        deadline_s = time.monotonic() + timeout_s
        while self._tasks:
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                break
            await asyncio.wait(set(self._tasks), timeout=left_s)
        if not self._tasks:
            return True
        late = set(self._tasks)
        log.warning("%s: %d background task(s) cancelled after %.1f s", self.owner, len(late), timeout_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        return False

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.num_failed += 1
            log.error("%s: background task %s failed: %s", self.owner, task.get_name(), exc, exc_info=exc)
