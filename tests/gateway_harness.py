"""The gateway built by its own wiring path (`services.gateway.main.build`) over a FakeBus, with FakeWorkers.

    harness = await make_harness(model_dir, output_text="Hello")   # app + scripted workers on one FakeBroker
    client = harness.openai()                                        # openai.AsyncOpenAI over the ASGI app
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from deepinfer.bus import MessageBus
from deepinfer.config import CommonSettings, GatewaySettings
from deepinfer.membership import Membership
from deepinfer.service import ServiceContext
from deepinfer.telemetry import new_registry
from deepinfer.testing import FakeBroker, FakeBus
from deepinfer.testing.checkpoints import TOKENIZER_DIR_MAX_MODEL_LEN
from deepinfer.testing.fake_workers import FakeWorkers
from deepinfer.tokenizer import Tokenizer
from services.gateway.app import ApiState
from services.gateway.handler import GatewayHandler
from services.gateway.main import build

MODEL = "tiny"
GATEWAY_ID = "gw-test"
ANSWER = "Hello, world! How are you today?"
MAX_MODEL_LEN = TOKENIZER_DIR_MAX_MODEL_LEN


def gateway_settings(model_dir: Path, **fields: Any) -> GatewaySettings:
    """Settings of a test gateway serving `model_dir` as MODEL (never bound: tests drive the ASGI app)."""
    common = CommonSettings(model=str(model_dir), served_model_name=MODEL)
    return GatewaySettings(common=common, **{"gateway_id": GATEWAY_ID, **fields})


@dataclass
class Harness:
    """A gateway app, its state, the scripted workers and the tokenizer."""

    gateway: GatewayHandler
    fake: FakeWorkers

    @property
    def app(self) -> Any:
        """The ASGI app."""
        return self.gateway.app

    @property
    def state(self) -> ApiState:
        """The routes' state."""
        return self.gateway.state

    @property
    def workers(self) -> Membership:
        """The gateway's membership table."""
        return self.gateway.membership

    @property
    def tokenizer(self) -> Tokenizer:
        """The served model's tokenizer."""
        return self.gateway.state.model.tokenizer

    def http(self) -> httpx.AsyncClient:
        """An httpx client on the app through the ASGI transport."""
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gw")

    def openai(self, api_key: str = "none") -> openai.AsyncOpenAI:
        """The official client on the app (no retries)."""
        return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=api_key, http_client=self.http(), max_retries=0)


async def make_harness(
    model_dir: Path,
    output_text: str = ANSWER,
    gateway_bus: MessageBus | None = None,
    worker_bus: MessageBus | None = None,
    settings: dict[str, Any] | None = None,
    tracer: Any = None,
    **fake_options: Any,
) -> Harness:
    """The gateway (settings from `settings`) on `gateway_bus`, and FakeWorkers scripted to answer
    `output_text` on `worker_bus`. Without buses, both are FakeBus clients of one new FakeBroker."""
    if gateway_bus is None or worker_bus is None:
        broker = FakeBroker()
        gateway_bus, worker_bus = FakeBus(broker, "gateway"), FakeBus(broker, "workers")
    ctx = ServiceContext("gateway", gateway_settings(model_dir, **(settings or {})), gateway_bus,
                         new_registry(False), tracer)
    gateway = await build(ctx)
    await gateway.subscribe()
    output_ids = gateway.state.model.tokenizer.encode(output_text, add_special_tokens=False)
    fake = FakeWorkers(worker_bus, MODEL, output_ids, **fake_options)
    await fake.start()
    return Harness(gateway, fake)
