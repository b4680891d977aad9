"""Child-process helpers shared by the supervisor and the private nats-server: parent-death signal, process-group
signals, exit descriptions."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
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


def describe_exit(code: int) -> str:
    """`code 1`, or `signal SIGKILL` for a negative Popen return code."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"code {code}"


def signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    """Send `sig` to the process group `process` leads (a child started with start_new_session=True)."""
    # start_new_session made the child its group's leader: its pgid is its pid. A group whose members are
    # all gone (or a leader already reaped with no members left) raises ProcessLookupError: nothing to do.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
