"""Readiness probes the supervisor polls: a service's internal `/ready`, or a TCP server's greeting."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ProbeResult:
    """One probe answer: ready or not, and why not (a short phrase)."""

    ready: bool
    reason: str = ""


class Probe(Protocol):
    """A cheap, bounded check (it must return within about a second)."""

    def __call__(self) -> ProbeResult:
        """Probe once."""
        ...


@dataclass(frozen=True)
class HttpReadyProbe:
    """GET `url`: 200 is ready; a 503 carries the service's `reason` (deepinfer.telemetry's /ready body)."""

    url: str
    timeout_s: float = 1.0

    def __call__(self) -> ProbeResult:
        """Probe once."""
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:
                return ProbeResult(response.status == 200, f"HTTP {response.status}")
        except urllib.error.HTTPError as exc:
            return ProbeResult(False, _reason_of(exc))
        except (OSError, ValueError) as exc:  # refused, reset, timed out: not listening yet
            return ProbeResult(False, f"not answering on {self.url} ({_short(exc)})")


@dataclass(frozen=True)
class TcpGreetingProbe:
    """Connect to host:port and read the first bytes; ready when they start with `greeting` (NATS: INFO)."""

    host: str
    port: int
    greeting: bytes = b"INFO"
    timeout_s: float = 0.5

    def __call__(self) -> ProbeResult:
        """Probe once."""
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout_s) as sock:
                first = sock.recv(len(self.greeting))
        except OSError as exc:
            return ProbeResult(False, f"not accepting on {self.host}:{self.port} ({_short(exc)})")
        if first.startswith(self.greeting):
            return ProbeResult(True)
        return ProbeResult(False, f"unexpected greeting {first!r}")


@dataclass
class LivenessWatch:
    """A child is hung when its liveness probe, after passing once, has failed for `timeout_s` (a stopped or
    deadlocked process exits nothing, so only this notices it). Not passed yet (still loading) never counts."""

    probe: Probe
    timeout_s: float
    interval_s: float = 1.0
    last_alive_s: float | None = None
    last_probe_s: float = float("-inf")

    def due(self, now_s: float) -> bool:
        """Whether it is time to probe again."""
        return now_s - self.last_probe_s >= self.interval_s

    def observe(self, alive: bool, now_s: float) -> bool:
        """Record one probe; True when the child is hung (alive once, silent for more than timeout_s since)."""
        self.last_probe_s = now_s
        if alive:
            self.last_alive_s = now_s
            return False
        return self.last_alive_s is not None and now_s - self.last_alive_s > self.timeout_s

    def reset(self) -> None:
        """A new process: it has to pass once before silence counts."""
        self.last_alive_s, self.last_probe_s = None, float("-inf")


def _reason_of(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"{}")
    except (OSError, ValueError):
        body = {}
    reason = body.get("reason") if isinstance(body, dict) else None
    return str(reason) if reason else f"HTTP {exc.code}"


def _short(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason if reason is not None else exc) or type(exc).__name__
