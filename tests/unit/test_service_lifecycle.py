"""deepinfer.service: start order, the "started" log line, /ready through SIGTERM and drain, exit codes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import httpx
import pytest

from deepinfer.bus import BusClosed, BusConnectError, MessageBus
from deepinfer.config import CommonSettings, SchedulerSettings
from deepinfer.service import EXIT_FAILED, EXIT_OK, Handler, Service, ServiceContext, redact_url, service_main
from deepinfer.testing import FakeBroker, FakeBus


class RecordingHandler:
    """A Handler that records its lifecycle calls; its drain waits until the test releases it."""

    def __init__(self, ctx: ServiceContext, block_drain: bool = False) -> None:
        self.ctx = ctx
        self.calls: list[str] = []
        self.drain_grace_s: float | None = None
        self.drain_entered = asyncio.Event()
        self.release_drain = asyncio.Event()
        if not block_drain:
            self.release_drain.set()
        self.ready = True

    async def start(self) -> None:
        self.calls.append("start")
        self.ctx.advertise_port("api", 4321)

    async def drain(self, grace_s: float) -> None:
        self.calls.append("drain")
        self.drain_grace_s = grace_s
        self.drain_entered.set()
        await self.release_drain.wait()

    async def close(self) -> None:
        self.calls.append("close")

    def is_ready(self) -> bool:
        return self.ready

    def not_ready_reason(self) -> str:
        return "" if self.ready else "model not loaded"


def settings(nats_url: str = "nats://127.0.0.1:4222") -> SchedulerSettings:
    common = CommonSettings(nats_url=nats_url, log_format="text")
    return SchedulerSettings(common=common, internal_port=0, scheduler_id="sched-test")


class Harness:
    """A Service on a FakeBus with a RecordingHandler, run as a task."""

    def __init__(self, block_drain: bool = False, nats_url: str = "nats://127.0.0.1:4222", **options) -> None:
        self.bus = FakeBus(FakeBroker(), "service")
        self.connected_with: list[tuple[CommonSettings, str]] = []
        self.handler: RecordingHandler | None = None
        self.block_drain = block_drain
        self.service = Service(settings(nats_url), self.build, connect=self.connect, **options)

    async def connect(self, common: CommonSettings, client_name: str) -> MessageBus:
        self.connected_with.append((common, client_name))
        return self.bus

    async def build(self, ctx: ServiceContext) -> Handler:
        assert ctx.bus is self.bus and ctx.name == "scheduler"
        self.handler = RecordingHandler(ctx, self.block_drain)
        return self.handler

    async def start(self) -> asyncio.Task[int]:
        task = asyncio.create_task(self.service.run())
        await asyncio.wait_for(self.service.started.wait(), 10.0)
        return task

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.service.internal_port}{path}"


async def test_sigterm_turns_readiness_off_before_the_drain_ends_then_exits_zero(caplog):
    caplog.set_level(logging.INFO, logger="deepinfer.service")
    harness = Harness(block_drain=True, drain_grace_s=7.5)
    task = await harness.start()
    handler = harness.handler
    assert handler is not None and handler.calls == ["start"]
    async with httpx.AsyncClient(timeout=5.0) as client:
        assert (await client.get(harness.url("/health"))).status_code == 200
        assert (await client.get(harness.url("/ready"))).status_code == 200
        assert (await client.get(harness.url("/metrics"))).status_code == 200

        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(handler.drain_entered.wait(), 5.0)
        ready = await client.get(harness.url("/ready"))
        assert ready.status_code == 503 and "stopping" in ready.json()["reason"]
        assert not task.done() and handler.calls == ["start", "drain"]  # still draining

        handler.release_drain.set()
        assert await asyncio.wait_for(task, 10.0) == EXIT_OK
        with pytest.raises(httpx.ConnectError):
            await client.get(harness.url("/health"))
    assert handler.calls == ["start", "drain", "close"]
    assert handler.drain_grace_s == 7.5
    with pytest.raises(BusClosed):  # the bus was drained
        await harness.bus.publish("x.y", b"")
    assert any("SIGTERM received" in r.getMessage() for r in caplog.records)


async def test_started_line_names_ids_bound_ports_and_nats_url_without_credentials(caplog):
    caplog.set_level(logging.INFO, logger="deepinfer.service")
    harness = Harness(nats_url="nats://alice:s3cret@10.1.2.3:4222,nats://tok@10.1.2.4:4222")
    task = await harness.start()
    harness.service.stop()
    assert await asyncio.wait_for(task, 10.0) == EXIT_OK
    [line] = [r for r in caplog.records if "started" in r.getMessage()]
    port = harness.service.internal_port
    assert port is not None and port > 0  # settings asked for port 0: the real one is reported
    assert line.ports == {"internal": port, "api": 4321}
    assert line.ids == {"scheduler_id": "sched-test"}
    assert line.nats_url == "nats://10.1.2.3:4222,nats://10.1.2.4:4222"
    assert "s3cret" not in line.getMessage() and f"internal_port={port}" in line.getMessage()
    assert harness.connected_with[0][1] == "sched-test"


async def test_ready_reflects_the_handler_and_explains_why_not():
    harness = Harness()
    task = await harness.start()
    assert harness.handler is not None
    harness.handler.ready = False
    async with httpx.AsyncClient(timeout=5.0) as client:
        response = await client.get(harness.url("/ready"))
    assert response.status_code == 503 and response.json()["reason"] == "model not loaded"
    assert not harness.service.is_ready()
    harness.service.stop()
    assert await asyncio.wait_for(task, 10.0) == EXIT_OK


async def test_a_second_stop_cuts_a_hanging_drain_short():
    harness = Harness(block_drain=True, drain_grace_s=60.0)
    task = await harness.start()
    harness.service.stop()
    assert harness.handler is not None
    await asyncio.wait_for(harness.handler.drain_entered.wait(), 5.0)
    harness.service.stop()
    assert await asyncio.wait_for(task, 5.0) == EXIT_OK
    assert harness.handler.calls == ["start", "drain", "close"]


async def test_bus_connect_failure_exits_one_without_building():
    async def refuse(common: CommonSettings, client_name: str) -> MessageBus:
        raise BusConnectError(common.nats_url, "connection refused")

    built: list[ServiceContext] = []

    async def build(ctx: ServiceContext) -> Handler:
        built.append(ctx)
        raise AssertionError("must not be built")

    service = Service(settings(), build, connect=refuse, install_signal_handlers=False)
    assert await service.run() == EXIT_FAILED
    assert built == []


async def test_handler_start_failure_exits_one_and_still_closes_the_handler():
    harness = Harness()

    async def failing_start() -> None:
        raise RuntimeError("cannot subscribe")

    original_build = harness.build

    async def build(ctx: ServiceContext) -> Handler:
        handler = await original_build(ctx)
        handler.start = failing_start  # type: ignore[method-assign]
        return handler

    harness.service._build = build
    assert await asyncio.wait_for(harness.service.run(), 10.0) == EXIT_FAILED
    assert harness.handler is not None and harness.handler.calls == ["close"]


def test_service_main_exits_two_on_a_bad_setting(monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_SCHEDULER_WORKER_LEASE_S", "-1")

    async def build(ctx: ServiceContext) -> Handler:
        raise AssertionError("must not run")

    with pytest.raises(SystemExit) as exit_info:
        service_main(SchedulerSettings, build)
    assert exit_info.value.code == 2
    assert "DEEPINFER_SCHEDULER_WORKER_LEASE_S" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("nats://user:pw@nats:4222", "nats://nats:4222"),
        ("tls://token@nats.svc:4222, nats://b:4222", "tls://nats.svc:4222,nats://b:4222"),
    ],
)
def test_redact_url(url: str, shown: str):
    assert redact_url(url) == shown
