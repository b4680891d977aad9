"""`deepinfer up` as a real process: a private nats-server and the services, the `openai` client, Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from deepinfer.nats_server import free_port
from deepinfer.up.stack import service_available

pytestmark = pytest.mark.integration

WORKERS = service_available("prefill") and service_available("decode")
READY_TIMEOUT_S = 180.0  # the first start on a fresh machine prepares the default model (~20 s on a CPU)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts child processes through /proc")
@pytest.mark.parametrize("num_prefill", [1, 0], ids=["disaggregated", "decode-takes-both-roles"])
def test_up_serves_and_ctrl_c_leaves_nothing_behind(tmp_path: Path, num_prefill: int):
    port = free_port()
    args = ["--port", str(port), "--device", "cpu", "--prefill", str(num_prefill)]
    if not WORKERS:
        # Without workers the gateway cannot become ready; `up` then waits only for its /health.
        args += ["--prefill", "0", "--decode", "0"]
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "DEEPINFER_GATEWAY_API_KEYS": ""}
    stdout_path, stderr_path = tmp_path / "up.out", tmp_path / "up.err"
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        up = subprocess.Popen(
            [sys.executable, "-m", "deepinfer.cli", "up", *args], stdout=out, stderr=err, env=env
        )
    try:
        base_url = wait_for_banner(up, stdout_path, stderr_path)
        assert base_url == f"http://127.0.0.1:{port}/v1"
        children = descendants(up.pid)
        commands = {
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in children
        }
        expected = ["nats-server", "services.scheduler", "services.gateway"]
        expected += ["services.decode"] if WORKERS else []
        expected += ["services.prefill"] if WORKERS and num_prefill else []
        for name in expected:
            assert any(name in command for command in commands), (name, commands)

        client = openai.OpenAI(base_url=base_url, api_key="anything", max_retries=0, timeout=30.0)
        assert [model.id for model in client.models.list().data] == ["smollm2-135m-instruct"]
        if WORKERS:
            reply = client.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0,
                max_tokens=12,
            )
            assert "Paris" in (reply.choices[0].message.content or "")

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=40.0) == 0, stderr_path.read_text()[-3000:]
        leftovers = [pid for pid in children if alive(pid)]
        assert not leftovers, leftovers
        log_dir = tmp_path / "data" / "deepinfer" / "up" / "logs"
        assert (log_dir / "gateway-0.log").read_text().count("gateway stopped") == 1
        assert "SIGINT received: stopping" in stderr_path.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def wait_for_banner(up: subprocess.Popen[bytes], stdout_path: Path, stderr_path: Path) -> str:
    """The base URL `deepinfer up` prints once every service is ready."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        match = re.search(r"OpenAI base URL: (\S+)", stdout_path.read_text())
        if match:
            return match.group(1)
        if up.poll() is not None:
            pytest.fail(f"deepinfer up exited with {up.returncode}:\n{stderr_path.read_text()[-4000:]}")
        time.sleep(0.1)
    pytest.fail(f"deepinfer up not ready within {READY_TIMEOUT_S} s:\n{stderr_path.read_text()[-4000:]}")


def test_up_refuses_a_port_in_use(tmp_path: Path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
        result = subprocess.run(
            [sys.executable, "-m", "deepinfer.cli", "up", "--port", str(port)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert not (tmp_path / "deepinfer" / "up" / "logs").exists()  # nothing was started
