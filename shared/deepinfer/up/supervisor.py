"""Child processes kept alive: restart with exponential backoff, ordered stop, nothing left behind.

    supervisor = Supervisor(log_dir)                  # None: children write to the supervisor's stdout/stderr
    supervisor.add(ChildSpec("scheduler-0", argv, env, stop_tier=2, probe=HttpReadyProbe(url)))
    supervisor.start()                       # spawn all, then a monitor thread restarts what exits
    supervisor.wait_ready(timeout_s=300)     # every probe answers ready, or SupervisorError naming who did not
    supervisor.stop()                        # SIGTERM tier by tier, SIGKILL after the grace period

Every child runs in its own session (process group, no controlling terminal): a Ctrl-C at the terminal reaches
only the supervisor, which then stops the children in order, and signals go to the whole group so nothing a
child spawned outlives it. On Linux a child also gets SIGTERM if the supervisor itself dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from deepinfer.process import describe_exit, die_with_parent_preexec, signal_group
from deepinfer.up.child_spec import (  # noqa: F401  (re-exported: the supervisor's public names)
    EXIT_BAD_CONFIG,
    START_CRASHES,
    ChildSpec,
    RestartEvent,
    RestartPolicy,
    SupervisorError,
)
from deepinfer.up.logs import tail
from deepinfer.up.probes import LivenessWatch, ProbeResult

log = logging.getLogger(__name__)

@dataclass
class _Child:
    spec: ChildSpec
    log_path: Path | None  # None: the supervisor's own stdout/stderr
    process: subprocess.Popen[bytes] | None = None
    started_at_s: float = 0.0
    num_restarts: int = 0
    num_consecutive_failures: int = 0
    restart_due_s: float | None = None
    gave_up: bool = False
    spawn_requested: bool = False
    last_exit_code: int | None = None
    pids: list[int] = field(default_factory=list)
    liveness: LivenessWatch | None = None


class Supervisor:
    """Spawns children, restarts the ones that exit, reports readiness, and stops them in tiers.

    Lifecycle: `add()` specs → `start()` → (`wait_ready()`, `kill()`, `restart_count()`) → `stop()`.
    Thread-safe: a monitor thread restarts children while the caller polls or kills them.
    """

    def __init__(
        self,
        log_dir: Path | None,
        policy: RestartPolicy | None = None,
        grace_s: float = 30.0,
        poll_interval_s: float = 0.05,
        liveness_timeout_s: float = 10.0,
    ) -> None:
        self.log_dir = log_dir
        self.liveness_timeout_s = liveness_timeout_s
        self.policy = policy or RestartPolicy()
        self.grace_s = grace_s
        self.poll_interval_s = poll_interval_s
        self.events: list[RestartEvent] = []
        self._children: dict[str, _Child] = {}
        self._lock = threading.RLock()
        self._stopping = False
        self._done = threading.Event()
        self._monitor: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: SupervisorError | None = None
        self._prctl = die_with_parent_preexec()

    def add(self, spec: ChildSpec) -> None:
        """Register a child (spawned by `start()`, or by the monitor soon when already started)."""
        with self._lock:
            if spec.name in self._children:
                raise ValueError(f"duplicate child name {spec.name!r}")
            liveness = None if spec.liveness is None else LivenessWatch(spec.liveness, self.liveness_timeout_s)
            log_path = None if self.log_dir is None else self.log_dir / f"{spec.name}.log"
            self._children[spec.name] = _Child(spec, log_path, spawn_requested=True, liveness=liveness)

    @property
    def names(self) -> list[str]:
        """Child names in the order they were added."""
        return list(self._children)

    def log_path(self, name: str) -> Path | None:
        """The file a child's stdout and stderr go to (None: the supervisor's own)."""
        return self._children[name].log_path

    def start(self) -> None:
        """Start the monitor thread, which spawns every child (in the order added); SupervisorError if one fails."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        # Every child is spawned by the monitor thread, which outlives them all: PR_SET_PDEATHSIG fires when
        # the spawning *thread* exits, so spawning from a caller's short-lived thread would kill the child.
        self._monitor = threading.Thread(target=self._monitor_loop, name="deepinfer-supervisor", daemon=True)
        self._monitor.start()
        self._started.wait()
        if self._start_error is not None:
            self.stop()
            raise self._start_error

    def pid(self, name: str) -> int | None:
        """The running child's pid (None while it is down)."""
        process = self._children[name].process
        return process.pid if process is not None and process.poll() is None else None

    def spawned_pids(self) -> list[int]:
        """Every pid this supervisor ever spawned (restarts included), to check that none is left."""
        with self._lock:
            return [pid for child in self._children.values() for pid in child.pids]

    def restart_count(self, name: str) -> int:
        """How many times the child was restarted after an unexpected exit."""
        return self._children[name].num_restarts

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the child's process group (a failure test; the monitor restarts it as any crash)."""
        with self._lock:
            process = self._children[name].process
            if process is None or process.poll() is not None:
                raise SupervisorError(f"{name} is not running")
            signal_group(process, sig)

    def gave_up(self, name: str) -> bool:
        """Whether the child exited with a fatal code (a configuration error) and stays down."""
        return self._children[name].gave_up

    def probe(self, name: str) -> ProbeResult:
        """Probe one child now (not ready while it is down)."""
        child = self._children[name]
        if child.spec.probe is None:
            return ProbeResult(self.pid(name) is not None, "not running")
        return child.spec.probe()

    def wait_ready(
        self,
        timeout_s: float,
        on_ready: Callable[[str, float], None] | None = None,
        on_waiting: Callable[[dict[str, str], float], None] | None = None,
        report_every_s: float = 10.0,
    ) -> dict[str, float]:
        """Poll every probe until all are ready; returns name -> seconds to ready. SupervisorError otherwise."""
        started_s = time.monotonic()
        pending = {name: "starting" for name, child in self._children.items() if child.spec.probe is not None}
        restarts = {name: self._children[name].num_restarts for name in pending}
        ready_s: dict[str, float] = {}
        next_report_s = started_s + report_every_s
        while pending:
            for name in list(pending):
                self._raise_if_gave_up(name, self._children[name].num_restarts - restarts[name])
                result = self.probe(name)
                if result.ready:
                    del pending[name]
                    ready_s[name] = time.monotonic() - started_s
                    if on_ready is not None:
                        on_ready(name, ready_s[name])
                else:
                    pending[name] = result.reason
            now_s = time.monotonic()
            if pending and now_s - started_s > timeout_s:
                raise SupervisorError(self._not_ready_message(pending, timeout_s))
            if pending and on_waiting is not None and now_s >= next_report_s:
                on_waiting(dict(pending), now_s - started_s)
                next_report_s = now_s + report_every_s
            if pending:
                time.sleep(0.1)
        return ready_s

    def _raise_if_gave_up(self, name: str, num_crashes: int) -> None:
        """A child that will not start: one that exited with a configuration error, or crashed START_CRASHES
        times before it was ever ready (an import error loops forever otherwise)."""
        child = self._children[name]
        if child.gave_up:
            why = "is not restarted (a configuration error)"
        elif num_crashes >= START_CRASHES:
            why = f"crashed {num_crashes} times before it was ever ready"
        else:
            return
        raise SupervisorError(f"{name} exited with code {child.last_exit_code} and {why}{_log_tail(child)}")

    def _not_ready_message(self, pending: dict[str, str], timeout_s: float) -> str:
        lines = [f"not ready within {timeout_s:.0f} s: {', '.join(pending)}"]
        for name, reason in pending.items():
            child = self._children[name]
            lines.append(f"--- {name}: {reason} (restarts: {child.num_restarts}){_log_tail(child, 3000)}".rstrip())
        return "\n".join(lines)

    def stop(self) -> None:
        """SIGTERM the children tier by tier (lower first), SIGKILL what outlives the grace period."""
        with self._lock:
            self._stopping = True
        try:
            for tier in sorted({child.spec.stop_tier for child in self._children.values()}):
                self._stop_tier([c for c in self._children.values() if c.spec.stop_tier == tier])
        finally:
            # The monitor thread ends last: on Linux a child spawned by it gets PDEATHSIG when it exits.
            self._done.set()
            if self._monitor is not None:
                self._monitor.join(timeout=5.0)
                self._monitor = None

    def kill_all(self) -> None:
        """SIGKILL every child's process group now (a second Ctrl-C during `stop()`)."""
        with self._lock:
            self._stopping = True
            for child in self._children.values():
                if child.process is not None:
                    signal_group(child.process, signal.SIGKILL)

    def _stop_tier(self, children: list[_Child]) -> None:
        running = [c for c in children if c.process is not None and c.process.poll() is None]
        for child in running:
            assert child.process is not None
            signal_group(child.process, signal.SIGTERM)
        deadline_s = time.monotonic() + self.grace_s
        for child in children:
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=max(0.0, deadline_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: SIGKILL", child.spec.name, self.grace_s)
                signal_group(child.process, signal.SIGKILL)
                child.process.wait()
            # Whatever the child spawned and left in its group goes too.
            signal_group(child.process, signal.SIGKILL)
            child.process = None

    def _monitor_loop(self) -> None:
        try:
            with self._lock:
                for child in self._children.values():
                    child.spawn_requested = False
                    self._spawn(child)
        except SupervisorError as exc:
            self._start_error = exc
        finally:
            self._started.set()
        while not self._done.wait(self.poll_interval_s):
            with self._lock:
                if self._stopping:
                    continue
                for child in self._children.values():
                    self._check(child, time.monotonic())
                now_s = time.monotonic()
                due = [c for c in self._children.values() if c.process and c.liveness and c.liveness.due(now_s)]
            self._watch_liveness(due)  # probes take up to a second each: never under the lock

    def _watch_liveness(self, children: list[_Child]) -> None:
        """Probe each child's liveness; SIGKILL a hung one (the monitor then restarts it as any crash)."""
        for child in children:
            assert child.liveness is not None
            alive = child.liveness.probe().ready
            with self._lock:
                if child.process is None or self._stopping:
                    continue
                if child.liveness.observe(alive, time.monotonic()):
                    log.warning("%s has not answered its liveness probe for %.0f s: killing it to restart it",
                                child.spec.name, self.liveness_timeout_s)
                    signal_group(child.process, signal.SIGKILL)
                    child.liveness.reset()

    def _check(self, child: _Child, now_s: float) -> None:
        process = child.process
        if process is not None:
            code = process.poll()
            if code is not None:
                self._on_exit(child, code, now_s)
        elif child.spawn_requested:  # added after start()
            child.spawn_requested = False
            self._spawn(child)
        elif child.restart_due_s is not None and now_s >= child.restart_due_s:
            child.restart_due_s = None
            child.num_restarts += 1
            self._spawn(child)

    def _on_exit(self, child: _Child, code: int, now_s: float) -> None:
        assert child.process is not None
        signal_group(child.process, signal.SIGKILL)
        child.process = None
        child.last_exit_code = code
        ran_s = now_s - child.started_at_s
        if ran_s >= self.policy.reset_after_s:
            child.num_consecutive_failures = 0
        child.num_consecutive_failures += 1
        name = child.spec.name
        if code in self.policy.fatal_exit_codes:
            child.gave_up = True
            delay_s = None
            log.error(
                "%s exited with code %d after %.1f s: not restarted (configuration error)", name, code, ran_s
            )
        else:
            delay_s = self.policy.delay_s(child.num_consecutive_failures)
            child.restart_due_s = now_s + delay_s
            log.warning(
                "%s exited unexpectedly (%s) after %.1f s: restart %d in %.1f s",
                name,
                describe_exit(code),
                ran_s,
                child.num_restarts + 1,
                delay_s,
            )
        self.events.append(RestartEvent(name, code, ran_s, child.num_restarts, delay_s, now_s))

    def _spawn(self, child: _Child) -> None:
        spec = child.spec
        with contextlib.ExitStack() as files:
            log_file = None if child.log_path is None else files.enter_context(self._open_log(child))
            try:
                child.process = subprocess.Popen(
                    list(spec.argv),
                    env=dict(spec.env),
                    cwd=spec.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT if log_file is not None else None,
                    start_new_session=True,
                    preexec_fn=self._prctl,
                )
            except OSError as exc:
                if not self._started.is_set():
                    raise SupervisorError(f"cannot start {spec.name} ({spec.argv[0]}): {exc}") from exc
                log.error("cannot restart %s: %s", spec.name, exc)
                child.num_consecutive_failures += 1
                child.restart_due_s = time.monotonic() + self.policy.delay_s(child.num_consecutive_failures)
                return
        child.started_at_s = time.monotonic()
        child.pids.append(child.process.pid)
        if child.liveness is not None:
            child.liveness.reset()

    @staticmethod
    def _open_log(child: _Child) -> BinaryIO:
        """A fresh log per run of the supervisor; restarts append to it after a marker line."""
        assert child.log_path is not None
        log_file = child.log_path.open("ab" if child.pids else "wb")
        if child.pids:
            log_file.write(f"--- deepinfer up: restart {child.num_restarts} of {child.spec.name} ---\n".encode())
            log_file.flush()
        return log_file


def _log_tail(child: _Child, num_bytes: int = 4000) -> str:
    """"; last lines of <log>:\n<tail>" for an error message ("" when the child logs to the supervisor's output)."""
    if child.log_path is None:
        return ""
    return f"; last lines of {child.log_path}:\n{tail(child.log_path, num_bytes)}"
