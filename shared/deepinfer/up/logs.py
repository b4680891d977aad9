"""Child logs: each child writes to its own file; `LogEcho` copies new lines to the terminal, prefixed.

Children write straight to files (never to a pipe the supervisor must drain), so a slow terminal or a stopped
echo thread can never block a service, and the tail of a file is at hand for error messages.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TextIO


def tail(path: Path, num_bytes: int = 4000) -> str:
    """The last `num_bytes` of a log file as text ("<no log>" when it cannot be read)."""
    try:
        with path.open("rb") as file:
            size = file.seek(0, 2)
            file.seek(max(0, size - num_bytes))
            data = file.read()
    except OSError:
        return "<no log>"
    return data.decode(errors="replace")


class LogEcho:
    """A thread that follows log files and writes their new lines to `stream` as `name | line`.

    Lifecycle: `add()` files (before or after `start()`) → `start()` → `stop()` (copies what is left, joins).
    """

    def __init__(self, stream: TextIO, interval_s: float = 0.1) -> None:
        self.stream = stream
        self.interval_s = interval_s
        self._files: dict[str, tuple[Path, int, bytes]] = {}  # name -> (path, offset, partial line)
        self._width = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, name: str, path: Path) -> None:
        """Follow `path` from its current end, prefixing its lines with `name`."""
        offset = path.stat().st_size if path.exists() else 0
        with self._lock:
            self._files[name] = (path, offset, b"")
            self._width = max(self._width, len(name))

    def start(self) -> None:
        """Start the copying thread."""
        self._thread = threading.Thread(target=self._run, name="deepinfer-log-echo", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Copy what is left and stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        self.copy_new_lines(final=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.copy_new_lines()

    def copy_new_lines(self, final: bool = False) -> None:
        """Write every complete new line once (and a trailing partial one when `final`)."""
        with self._lock:
            for name, (path, offset, partial) in list(self._files.items()):
                try:
                    with path.open("rb") as file:
                        file.seek(offset)
                        data = file.read()
                except OSError:
                    continue
                buffered = partial + data
                *lines, rest = buffered.split(b"\n")
                if final and rest:
                    lines, rest = [*lines, rest], b""
                for line in lines:
                    self.stream.write(f"{name.ljust(self._width)} | {line.decode(errors='replace')}\n")
                self._files[name] = (path, offset + len(data), rest)
            self.stream.flush()
