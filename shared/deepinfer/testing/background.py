"""A second client beside the one under test: what someone else's small requests get meanwhile (issue #40's "no harm
to anyone else"), used by the hostile-client e2e tests and bench/gateway/hostile.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BackgroundClient:
    """Calls `send` one request after another (`pause_s` between) until the block exits; `outcomes` holds each one's
    result (what `send` returned, or the exception's type name: what that client saw) and its latency in seconds."""

    def __init__(self, send: Callable[[], object], pause_s: float = 0.1) -> None:
        self.send, self.pause_s = send, pause_s
        self.outcomes: list[tuple[object, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BackgroundClient:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                outcome = self.send()
            except Exception as exc:  # noqa: BLE001 - the second client records what it saw
                outcome = type(exc).__name__
            self.outcomes.append((outcome, time.monotonic() - started))
            self._stop.wait(self.pause_s)
