"""A worker whose engine failed or whose step hangs answers /health 503 (so it is restarted); loading is fine."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx

from deepinfer.telemetry import internal_app, new_registry
from deepinfer.testing.fake_engine import ScriptedEngine
from deepinfer.worker.engine_loop import EngineLoop
from deepinfer.worker.runtime import WorkerRuntime


class HangingEngine(ScriptedEngine):
    """One step that blocks until released, or raises if told."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(num_steps=1)
        self.release, self.fail = threading.Event(), fail

    def run_step(self) -> None:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.release.wait(10)


def runtime_over(engine_loop: EngineLoop | None, deadline_s: float) -> WorkerRuntime:
    runtime = WorkerRuntime.__new__(WorkerRuntime)  # only what unhealthy_reason reads
    runtime.engine_loop, runtime.settings = engine_loop, SimpleNamespace(engine_step_deadline_s=deadline_s)
    return runtime


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_a_step_past_its_deadline_is_unhealthy_until_it_returns():
    assert runtime_over(None, 0.2).unhealthy_reason() == ""  # loading the model is not a fault
    engine = HangingEngine()
    loop = EngineLoop(engine, asyncio.get_running_loop(), lambda outputs, events: None)
    loop.start()
    runtime = runtime_over(loop, 0.2)
    await wait_for(lambda: loop.step_started_s is not None)
    # a step in progress, within its deadline (a long one: the step may be 0.2 s old by now on a busy machine)
    assert runtime_over(loop, 60.0).unhealthy_reason() == ""
    await wait_for(lambda: runtime.unhealthy_reason() != "")
    assert "engine step running for" in runtime.unhealthy_reason()
    engine.release.set()
    await wait_for(lambda: loop.step_started_s is None)
    assert runtime.unhealthy_reason() == ""
    await loop.stop()
    assert runtime.unhealthy_reason() == ""  # a stopped engine is a shutdown, not a fault


async def test_a_failed_engine_thread_is_unhealthy():
    loop = EngineLoop(HangingEngine(fail=True), asyncio.get_running_loop(), lambda outputs, events: None)
    loop.start()
    runtime = runtime_over(loop, 60.0)
    await wait_for(lambda: not loop.alive)
    assert "engine failed: CUDA error" in runtime.unhealthy_reason()


async def test_health_answers_503_with_the_reason():
    reason = {"text": ""}
    app = internal_app(new_registry(process_metrics=False), lambda: True, "decode",
                       unhealthy_reason=lambda: reason["text"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://i") as client:
        assert (await client.get("/health")).status_code == 200
        reason["text"] = "engine step running for 130 s (engine_step_deadline_s=120)"
        response = await client.get("/health")
    assert response.status_code == 503
    assert response.json() == {"status": "unhealthy", "service": "decode", "reason": reason["text"]}
