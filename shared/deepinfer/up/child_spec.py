"""What the supervisor is told about a child (ChildSpec), how it restarts one (RestartPolicy), and what it reports
(RestartEvent, SupervisorError); deepinfer.up.supervisor runs them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deepinfer.up.probes import Probe

#: A service's exit status for a bad setting (deepinfer.config.loading): restarting cannot help.
EXIT_BAD_CONFIG = 2
#: Crashes of a child while `wait_ready` waits for it that end the wait (it is not going to start).
START_CRASHES = 5


class SupervisorError(RuntimeError):
    """A child could not be started, gave up, or did not become ready in time."""


@dataclass(frozen=True)
class RestartPolicy:
    """Delay before restart n (1-based) of a child: initial · 2^(n-1), capped; reset after a long enough run."""

    initial_delay_s: float = 0.5
    max_delay_s: float = 10.0
    reset_after_s: float = 30.0
    #: Exit codes after which a child stays down (a configuration error exits 2).
    fatal_exit_codes: tuple[int, ...] = (EXIT_BAD_CONFIG,)

    def delay_s(self, num_consecutive_failures: int) -> float:
        """Seconds to wait before restarting after the n-th consecutive failure (n >= 1)."""
        exponent = max(0, num_consecutive_failures - 1)
        return min(self.max_delay_s, self.initial_delay_s * 2.0 ** min(exponent, 30))


@dataclass(frozen=True)
class ChildSpec:
    """How to run one child: argv, its whole environment, when it stops (lower tier first), its probe."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    stop_tier: int = 0
    probe: Probe | None = None
    cwd: Path | None = None
    #: Answers while the process works (its /health); once it has answered, silence past the supervisor's
    #: liveness timeout gets the process killed and restarted.
    liveness: Probe | None = None


@dataclass(frozen=True)
class RestartEvent:
    """A child exited unexpectedly: its exit code, how long it ran, and the delay before the next start."""

    name: str
    exit_code: int
    ran_s: float
    num_restarts: int
    delay_s: float | None  # None: not restarted (fatal exit code)
    exited_at_s: float  # time.monotonic()
