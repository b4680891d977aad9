"""deepinfer.up: the supervisor with tiny `python -c` children, device planning, and the stack's child plan."""

from __future__ import annotations

import logging
import os
import signal
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deepinfer.config import (
    CommonSettings,
    DecodeSettings,
    GatewaySettings,
    KvCacheSettings,
    PrefillSettings,
    SchedulerSettings,
    describe_settings,
)
from deepinfer.nats_server import free_port
from deepinfer.up.probes import HttpReadyProbe, ProbeResult
from deepinfer.up.stack import Stack
from deepinfer.up.supervisor import ChildSpec, RestartPolicy, Supervisor, SupervisorError

FAST = RestartPolicy(initial_delay_s=0.1, max_delay_s=0.4, reset_after_s=30.0)


def python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", textwrap.dedent(code))


def spec(name: str, code: str, tier: int = 0, probe=None) -> ChildSpec:
    return ChildSpec(name, python(code), dict(os.environ), stop_tier=tier, probe=probe)


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state != "Z"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def file_says(path: Path, text: str) -> Callable[[], ProbeResult]:
    return lambda: ProbeResult(path.exists() and text in path.read_text(), "not yet")


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path / "logs", FAST, grace_s=5.0)
    yield sup
    sup.stop()
    assert not [pid for pid in sup.spawned_pids() if alive(pid)]


def test_backoff_delays_double_up_to_the_cap():
    policy = RestartPolicy(initial_delay_s=0.5, max_delay_s=10.0)
    assert [policy.delay_s(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_crashing_child_restarts_with_growing_delay(supervisor: Supervisor, caplog):
    supervisor.add(spec("crasher", "import sys; sys.exit(3)"))
    with caplog.at_level(logging.WARNING, logger="deepinfer.up.supervisor"):
        supervisor.start()
        wait_until(lambda: supervisor.restart_count("crasher") >= 4)
    events = [e for e in supervisor.events if e.name == "crasher"][:4]
    assert [e.exit_code for e in events] == [3, 3, 3, 3]
    assert [e.delay_s for e in events] == [0.1, 0.2, 0.4, 0.4]
    # the wait really grew, not only the number: each restart started at least its delay after the exit before
    # it, both read by the supervisor's monitor thread (a child's start-up time, which a busy machine stretches
    # by more than the delays differ, is not in these)
    restarted_at_s = [e.exited_at_s - e.ran_s for e in events[1:]]
    waits_s = [started - exit.exited_at_s for exit, started in zip(events, restarted_at_s, strict=False)]
    assert all(wait_s >= delay for wait_s, delay in zip(waits_s, [0.1, 0.2, 0.4], strict=True)), waits_s
    assert len(set(supervisor.spawned_pids())) >= 5
    messages = [r.getMessage() for r in caplog.records]
    assert any("crasher exited unexpectedly (code 3)" in m and "restart 1 in 0.1 s" in m for m in messages)


def test_backoff_resets_after_a_long_enough_run(tmp_path: Path):
    sup = Supervisor(tmp_path, RestartPolicy(initial_delay_s=0.1, max_delay_s=5.0, reset_after_s=0.2))
    sup.add(spec("slow-crasher", "import sys, time; time.sleep(0.3); sys.exit(1)"))
    sup.start()
    try:
        wait_until(lambda: sup.restart_count("slow-crasher") >= 3)
    finally:
        sup.stop()
    assert [e.delay_s for e in sup.events[:3]] == [0.1, 0.1, 0.1]


def test_configuration_error_is_not_restarted_and_fails_wait_ready(supervisor: Supervisor):
    supervisor.add(
        spec(
            "bad-config",
            "import sys; print('invalid setting X'); sys.exit(2)",
            probe=lambda: ProbeResult(False, "starting"),
        )
    )
    supervisor.start()
    with pytest.raises(SupervisorError, match="bad-config exited with code 2") as info:
        supervisor.wait_ready(timeout_s=10.0)
    assert "invalid setting X" in str(info.value)
    time.sleep(0.3)
    assert supervisor.restart_count("bad-config") == 0


def test_a_child_crashing_before_it_is_ever_ready_fails_wait_ready(tmp_path: Path):
    # An import error loops forever under the restart policy; wait_ready says so instead of waiting it out.
    sup = Supervisor(tmp_path, RestartPolicy(initial_delay_s=0.05, max_delay_s=0.05))
    sup.add(spec("broken", "import no_such_module_here", probe=lambda: ProbeResult(False, "starting")))
    sup.start()
    try:
        started = time.monotonic()
        with pytest.raises(SupervisorError, match="broken exited with code 1 and crashed 5 times") as info:
            sup.wait_ready(timeout_s=60.0)
        assert time.monotonic() - started < 30
        assert "No module named 'no_such_module_here'" in str(info.value)
    finally:
        sup.stop()


def test_killed_child_is_restarted(supervisor: Supervisor, tmp_path: Path):
    supervisor.add(spec("sleeper", "import time; time.sleep(60)"))
    supervisor.start()
    first = supervisor.pid("sleeper")
    assert first is not None
    supervisor.kill("sleeper", signal.SIGKILL)
    wait_until(lambda: supervisor.pid("sleeper") not in (None, first))
    assert supervisor.restart_count("sleeper") == 1
    assert supervisor.events[0].exit_code == -signal.SIGKILL
    assert "restart 1 of sleeper" in supervisor.log_path("sleeper").read_text()


def test_stop_goes_tier_by_tier_and_leaves_no_process(tmp_path: Path):
    order = tmp_path / "order.txt"
    pid_file = tmp_path / "grandchild.pid"
    code = f"""
        import signal, subprocess, sys, time
        name = sys.argv[1]
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        if name == "api":
            open({str(pid_file)!r}, "w").write(str(grandchild.pid))
        def on_term(*_):
            with open({str(order)!r}, "a") as f:
                f.write(name + "\\n")
            time.sleep(0.2)  # a drain: the next tier must wait for it
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("up", flush=True)
        time.sleep(60)
    """
    sup = Supervisor(tmp_path / "logs", FAST, grace_s=5.0)
    for name, tier in (("nats", 3), ("worker", 1), ("api", 0), ("router", 2)):
        log = tmp_path / "logs" / f"{name}.log"
        argv = (*python(code), name)
        sup.add(ChildSpec(name, argv, dict(os.environ), stop_tier=tier, probe=file_says(log, "up")))
    sup.start()
    sup.wait_ready(timeout_s=20.0)
    wait_until(pid_file.exists)
    grandchild = int(pid_file.read_text())
    pids = sup.spawned_pids()
    sup.stop()
    assert order.read_text().split() == ["api", "worker", "router", "nats"]
    assert not [pid for pid in [*pids, grandchild] if alive(pid)]
    assert sup.restart_count("api") == 0  # a stop is not a crash


def test_child_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path):
    log = tmp_path / "logs" / "stubborn.log"
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        time.sleep(60)
    """
    sup = Supervisor(tmp_path / "logs", FAST, grace_s=0.5)
    sup.add(spec("stubborn", code, probe=file_says(log, "ignoring SIGTERM")))
    sup.start()
    sup.wait_ready(timeout_s=20.0)
    pid = sup.pid("stubborn")
    started = time.monotonic()
    sup.stop()
    took_s = time.monotonic() - started
    assert 0.45 <= took_s < 30.0  # the grace (0.5 s), then SIGKILL: never the child's 60 s sleep
    assert pid is not None and not alive(pid)


def test_wait_ready_polls_http_ready_until_200(supervisor: Supervisor):
    port = free_port()
    server = f"""
        import http.server, json, time
        started = time.monotonic()
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                ready = time.monotonic() - started > 0.6
                body = json.dumps({{"status": "ready"}} if ready else {{"reason": "loading the model"}}).encode()
                self.send_response(200 if ready else 503)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            def log_message(self, *args):
                pass
        http.server.HTTPServer(("127.0.0.1", {port}), Handler).serve_forever()
    """
    probe = HttpReadyProbe(f"http://127.0.0.1:{port}/ready")
    assert not probe().ready and "not answering" in probe().reason
    supervisor.add(spec("web", server, probe=probe))
    supervisor.start()
    wait_until(lambda: probe().reason == "loading the model" or probe().ready)
    ready_s = supervisor.wait_ready(timeout_s=20.0)
    assert probe().ready
    assert 0.3 < ready_s["web"] < 20.0


def test_wait_ready_timeout_names_the_service_and_shows_its_log(supervisor: Supervisor):
    supervisor.add(spec("quick", "import time; time.sleep(60)", probe=lambda: ProbeResult(True)))
    code = "import time; print('hello from the stuck one', flush=True); time.sleep(60)"
    supervisor.add(spec("stuck", code, probe=lambda: ProbeResult(False, "no worker yet")))
    supervisor.start()
    with pytest.raises(SupervisorError) as info:
        supervisor.wait_ready(timeout_s=1.0)
    message = str(info.value)
    assert message.startswith("not ready within 1 s: stuck")
    assert "stuck: no worker yet" in message and "hello from the stuck one" in message
    assert "quick" not in message.splitlines()[0]


HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_hung_child_is_killed_and_restarted(tmp_path: Path):
    port = free_port()
    liveness = HttpReadyProbe(f"http://127.0.0.1:{port}/health", timeout_s=0.2)
    child = ChildSpec("worker", (sys.executable, "-c", HEALTH_SERVER, str(port)), dict(os.environ),
                      probe=liveness, liveness=liveness)
    supervisor = Supervisor(tmp_path, FAST, grace_s=2.0, liveness_timeout_s=1.0)
    supervisor.add(child)
    supervisor.start()
    try:
        supervisor.wait_ready(10.0)
        first = supervisor.pid("worker")
        time.sleep(1.5)  # answering: never killed, however long it runs
        assert supervisor.pid("worker") == first and supervisor.restart_count("worker") == 0
        os.kill(first, signal.SIGSTOP)  # hung: it exits nothing, only its silence shows
        wait_until(lambda: supervisor.restart_count("worker") == 1 and supervisor.pid("worker") not in (None, first),
                   timeout_s=10.0)
        supervisor.wait_ready(10.0)  # the new process serves
        assert not alive(first)
    finally:
        supervisor.stop()


def test_a_child_that_never_answered_yet_is_not_killed_for_silence(tmp_path: Path):
    liveness = HttpReadyProbe(f"http://127.0.0.1:{free_port()}/health", timeout_s=0.1)  # nobody listens there
    supervisor = Supervisor(tmp_path, FAST, grace_s=2.0, liveness_timeout_s=0.3)
    supervisor.add(ChildSpec("loading", python("import time; time.sleep(30)"), dict(os.environ), liveness=liveness))
    supervisor.start()
    try:
        pid = supervisor.pid("loading")
        time.sleep(1.5)  # five timeouts of silence, but it never answered: a model still loading
        assert supervisor.pid("loading") == pid and supervisor.restart_count("loading") == 0
    finally:
        supervisor.stop()


def test_start_fails_clearly_for_a_missing_binary(tmp_path: Path):
    sup = Supervisor(tmp_path)
    sup.add(ChildSpec("ghost", ("/nonexistent/binary",), {}))
    with pytest.raises(SupervisorError, match="cannot start ghost"):
        sup.start()


def test_stack_plan_passes_settings_every_service_accepts(tmp_path: Path, monkeypatch):
    stack = Stack(
        port=0, num_prefill=2, num_decode=1, num_schedulers=2, log_dir=tmp_path, num_gpus=0, base_env={}
    )
    specs = {s.name: s for s in stack.plan()}
    assert list(specs) == [
        "nats",
        "scheduler-0",
        "scheduler-1",
        "kvcache-0",
        "prefill-0",
        "prefill-1",
        "decode-0",
        "gateway-0",
    ]
    assert [specs[n].stop_tier for n in ("gateway-0", "prefill-0", "decode-0", "scheduler-0", "nats")] == [
        0, 1, 1, 2, 3
    ]  # fmt: skip
    classes = {"scheduler": SchedulerSettings, "prefill": PrefillSettings, "decode": DecodeSettings,
               "kvcache": KvCacheSettings}
    classes["gateway"] = GatewaySettings
    known_envs = {row.env for row in describe_settings()}
    ports = set()
    for name, child in specs.items():
        if name == "nats":
            continue
        assert child.argv[1:] == ("-m", f"services.{stack.kinds[name]}")
        for key in os.environ:
            if key.startswith("DEEPINFER_"):
                monkeypatch.delenv(key)
        for key, value in child.env.items():
            assert not key.startswith("DEEPINFER_") or key in known_envs, key
            monkeypatch.setenv(key, value)
        settings = classes[stack.kinds[name]](common=CommonSettings())
        assert settings.common.nats_url == stack.nats.url
        assert settings.common.nats_token.get_secret_value() == stack.nats.token
        assert settings.common.data_plane_secret.get_secret_value() == stack.data_plane_secret
        assert settings.common.internal_host == "127.0.0.1"
        assert settings.internal_port == stack.internal_ports[name] and settings.internal_port > 0
        ports.add(settings.internal_port)
        if isinstance(settings, PrefillSettings | DecodeSettings):
            assert (settings.worker_id, settings.data_plane_port, settings.data_plane_host) == (
                name,
                0,
                "127.0.0.1",
            )
        if isinstance(settings, GatewaySettings):
            assert (settings.gateway_id, settings.port, settings.host) == (
                "gateway-0",
                stack.port,
                "127.0.0.1",
            )
    assert len(ports) == 7  # one internal port each, all different
    assert stack.base_url == f"http://127.0.0.1:{stack.port}/v1"
    nats_config = (tmp_path / "nats-server.conf").read_text()
    assert stack.nats.token in nats_config and (tmp_path / "nats-server.conf").stat().st_mode & 0o077 == 0


def test_several_gateways_share_the_api_port(tmp_path: Path):
    from deepinfer.up.stack import default_num_gateways

    assert [default_num_gateways(n) for n in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
    stack = Stack(port=0, num_gateways=3, log_dir=tmp_path, num_gpus=0, base_env={})
    specs = {s.name: s for s in stack.plan() if stack.kinds[s.name] == "gateway"}
    assert list(specs) == ["gateway-0", "gateway-1", "gateway-2"]
    envs = [spec.env for spec in specs.values()]
    assert {env["DEEPINFER_GATEWAY_PORT"] for env in envs} == {str(stack.port)}
    assert {env["DEEPINFER_GATEWAY_REUSE_PORT"] for env in envs} == {"true"}
    assert len({env["DEEPINFER_GATEWAY_GATEWAY_ID"] for env in envs}) == 3
    assert len({env["DEEPINFER_GATEWAY_INTERNAL_PORT"] for env in envs}) == 3
    single = Stack(port=0, num_gateways=1, log_dir=tmp_path / "one", num_gpus=0, base_env={})
    (gateway,) = [s for s in single.plan() if s.name.startswith("gateway")]
    assert gateway.env["DEEPINFER_GATEWAY_REUSE_PORT"] == "false"


def test_without_prefill_workers_the_gateway_still_waits_for_a_decode_worker(tmp_path: Path):
    stack = Stack(port=0, num_prefill=0, num_decode=1, num_gateways=1, log_dir=tmp_path, num_gpus=0, base_env={})
    (gateway,) = [s for s in stack.plan() if s.name == "gateway-0"]
    assert stack.gateway_waits_for_workers and gateway.probe.url.endswith("/ready")
