"""`python -m services.gateway` with processes=2 over a real nats-server: a parent and two gateway processes on
one API port, scripted workers on NATS (deepinfer.testing.FakeWorkers) so that the gateways become ready."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.bus import Bus
from deepinfer.nats_server import NatsServer, free_port
from deepinfer.testing.checkpoints import write_tokenizer_dir
from deepinfer.testing.fake_workers import FakeWorkers
from tests.gateway_harness import MODEL
from tests.integration.test_up import alive, descendants

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT, /proc"),
]

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_ID = "gwpool"
#: Well past the 2 s stream drained in the SIGTERM test, on a busy machine too (the processes exit once drained).
DRAIN_GRACE_S = 5.0


@pytest.fixture
async def workers(nats_server: NatsServer) -> AsyncIterator[FakeWorkers]:
    """A scripted scheduler, prefill and decode worker, heartbeating (the gateways' /ready needs a decode worker)."""
    bus = await Bus.connect(nats_server.url, name="workers", token=nats_server.token)
    fake = FakeWorkers(bus, MODEL, list(range(40, 48)))
    await fake.start()

    async def beat() -> None:
        while True:
            await fake.heartbeat()
            await asyncio.sleep(0.5)

    task = asyncio.create_task(beat())
    yield fake
    task.cancel()
    await fake.stop()
    await bus.close()


@pytest.fixture
def pool(nats_server: NatsServer, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, int, Path]]:
    """The parent process (processes=2), its API port, its internal port and its log."""
    api_port, internal_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'shared'}:{ROOT}",
        "DEEPINFER_NATS_URL": nats_server.url,
        "DEEPINFER_NATS_TOKEN": nats_server.token,
        "DEEPINFER_MODEL": str(write_tokenizer_dir(tmp_path / "tok")),
        "DEEPINFER_SERVED_MODEL_NAME": MODEL,
        "DEEPINFER_LOG_FORMAT": "text",
        "DEEPINFER_GATEWAY_PROCESSES": "2",
        "DEEPINFER_GATEWAY_GATEWAY_ID": GATEWAY_ID,
        "DEEPINFER_GATEWAY_PORT": str(api_port),
        "DEEPINFER_GATEWAY_INTERNAL_PORT": str(internal_port),
        "DEEPINFER_GATEWAY_DRAIN_GRACE_S": str(DRAIN_GRACE_S),
    }
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        parent = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env, cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield parent, api_port, internal_port, log
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()


async def wait_for(client: httpx.AsyncClient, url: str, timeout_s: float, status: int = 200) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = await client.get(url)
            if response.status_code == status:
                return response
            last = f"{response.status_code} {response.text}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} did not answer {status} within {timeout_s} s: {last}")


async def gateway_ids(api_port: int, want: int, attempts: int = 50) -> set[str]:
    """`x-deepinfer-gateway` of answers on fresh connections (the kernel spreads them) until `want` differ."""
    seen: set[str] = set()
    for _ in range(attempts):
        async with httpx.AsyncClient() as fresh:
            response = await fresh.get(f"http://127.0.0.1:{api_port}/v1/models")
        assert response.status_code == 200 and response.json()["data"][0]["id"] == MODEL
        seen.add(response.headers["x-deepinfer-gateway"])
        if len(seen) >= want:
            break
    return seen


async def test_two_processes_share_the_port_restart_and_stop(workers: FakeWorkers, pool):
    parent, api_port, internal_port, log = pool
    internal = f"http://127.0.0.1:{internal_port}"
    async with httpx.AsyncClient(timeout=5.0) as client:
        try:
            await wait_for(client, f"{internal}/ready", timeout_s=30.0)
        except AssertionError:
            raise AssertionError(log.read_text()[-3000:]) from None
        assert await gateway_ids(api_port, 2) == {f"{GATEWAY_ID}-0", f"{GATEWAY_ID}-1"}
        chat = await client.post(f"http://127.0.0.1:{api_port}/v1/chat/completions",
                                 json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 200, chat.text

        metrics = (await client.get(f"{internal}/metrics")).text
        assert 'gateway_process="0"' in metrics and 'gateway_process="1"' in metrics
        assert metrics.count("# TYPE deepinfer_gateway_requests_total counter") == 1

        children = descendants(parent.pid)
        assert len(children) == 2, children
        victim = min(children)
        os.kill(victim, signal.SIGKILL)
        await wait_for(client, f"{internal}/health", timeout_s=5.0, status=503)  # one process is down
        await wait_for(client, f"{internal}/ready", timeout_s=20.0)
        restarted = descendants(parent.pid)
        assert len(restarted) == 2 and victim not in restarted, restarted
        assert "exited unexpectedly (signal SIGKILL)" in log.read_text()
        (restarts,) = [f for f in text_string_to_metric_families((await client.get(f"{internal}/metrics")).text)
                       if f.name == "deepinfer_gateway_process_restarts"]
        assert sorted(sample.value for sample in restarts.samples) == [0.0, 1.0]

        # SIGTERM with a stream in flight: the processes drain it, then all exit, within the grace
        workers.tokens_per_step, workers.step_delay_s = 1, 0.25  # 2 s: readiness is seen off while it drains
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
        async with client.stream("POST", f"http://127.0.0.1:{api_port}/v1/chat/completions", json=body) as stream:
            lines = stream.aiter_lines()
            first = await anext(lines)
            started_s = time.monotonic()
            parent.send_signal(signal.SIGTERM)
            await wait_for(client, f"{internal}/ready", timeout_s=5.0, status=503)  # readiness off at once
            events = [line for line in [first] + [line async for line in lines] if line]
    assert events[-1] == "data: [DONE]" and '"finish_reason":"stop"' in "".join(events), events
    assert not any('"error"' in event for event in events), events
    assert await asyncio.to_thread(parent.wait, DRAIN_GRACE_S + 10.0) == 0, log.read_text()[-3000:]
    assert time.monotonic() - started_s < DRAIN_GRACE_S + 8.0
    assert not any(alive(pid) for pid in restarted)
    assert log.read_text().count("gateway drained in") == 2


@pytest.mark.slow
def test_a_process_that_never_starts_fails_the_parent(nats_server: NatsServer, tmp_path: Path):
    """Children that crash START_CRASHES times before they are ever ready (here: the API port is taken by a socket
    without SO_REUSEPORT) make the parent exit 1, so that the container restarts, instead of restarting them
    forever behind a /health of 503."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT / 'shared'}:{ROOT}",
            "DEEPINFER_NATS_URL": nats_server.url,
            "DEEPINFER_NATS_TOKEN": nats_server.token,
            "DEEPINFER_MODEL": str(write_tokenizer_dir(tmp_path / "tok")),
            "DEEPINFER_LOG_FORMAT": "text",
            "DEEPINFER_GATEWAY_PROCESSES": "2",
            "DEEPINFER_GATEWAY_PORT": str(taken.getsockname()[1]),
            "DEEPINFER_GATEWAY_INTERNAL_PORT": str(free_port("127.0.0.1")),
        }
        parent = subprocess.run([sys.executable, "-m", "services.gateway"], env=env, cwd=ROOT, capture_output=True,
                                timeout=60, text=True)
    output = parent.stdout + parent.stderr
    assert parent.returncode == 1, output[-3000:]
    assert "never started (5 crashes)" in output, output[-3000:]
