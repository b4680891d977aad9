"""Child-process helpers shared by the supervisor and the private nats-server."""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent_preexec() -> Callable[[], None] | None:
    """A preexec function asking Linux to SIGTERM the child when the spawning thread dies; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up now: nothing is loaded after fork
    except (OSError, AttributeError):
        return None

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))

    return die_with_parent
