"""Test support for the gateway: a tiny tokenizer directory and a gateway app over a FakeBus with FakeWorkers.

    harness = await make_harness(model_dir, output_text="Hello")   # app + scripted workers on one FakeBroker
    client = harness.openai()                                        # openai.AsyncOpenAI over the ASGI app
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from deepinfer.bus import MessageBus
from deepinfer.telemetry import new_registry
from deepinfer.testing import FakeBroker, FakeBus
from deepinfer.testing.checkpoints import CHAT_TEMPLATE, SPECIAL_TOKENS, make_tiny_tokenizer
from deepinfer.tokenizer import Tokenizer
from services.gateway.app import ApiState, create_app
from services.gateway.fake_workers import FakeWorkers
from services.gateway.handler import GatewayHandler, GatewayTimeouts
from services.gateway.metrics import GatewayMetrics
from services.gateway.recipe import ModelInfo
from services.gateway.streams import TokenStreams
from services.gateway.workers import WorkerTable

MODEL = "tiny"
GATEWAY_ID = "gw-test"
ANSWER = "Hello, world! How are you today?"
MAX_MODEL_LEN = 96


def write_tokenizer_dir(path: Path) -> Path:
    """tokenizer.json + tokenizer_config.json (with a chat template) of the tiny test tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    make_tiny_tokenizer(384).save(str(path / "tokenizer.json"))
    config = {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[3], "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@dataclass
class Harness:
    """A gateway app, its state, the scripted workers and the tokenizer."""

    app: Any
    state: ApiState
    fake: FakeWorkers
    workers: WorkerTable
    tokenizer: Tokenizer

    def http(self) -> httpx.AsyncClient:
        """An httpx client on the app through the ASGI transport."""
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gw")

    def openai(self, api_key: str = "none") -> openai.AsyncOpenAI:
        """The official client on the app (no retries)."""
        return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=api_key, http_client=self.http(), max_retries=0)


async def make_harness(
    model_dir: Path,
    output_text: str = ANSWER,
    api_keys: list[str] | None = None,
    timeouts: GatewayTimeouts | None = None,
    lease_s: float = 3.0,
    max_request_bytes: int = 1 << 20,
    gateway_bus: MessageBus | None = None,
    worker_bus: MessageBus | None = None,
    **fake_options: Any,
) -> Harness:
    """The API app on `gateway_bus` and FakeWorkers (scripted to answer `output_text`) on `worker_bus`.

    Without buses, both are FakeBus clients of one new FakeBroker.
    """
    if gateway_bus is None or worker_bus is None:
        broker = FakeBroker()
        gateway_bus, worker_bus = FakeBus(broker, "gateway"), FakeBus(broker, "workers")
    model = ModelInfo.from_dir(model_dir, MODEL, max_model_len=MAX_MODEL_LEN)
    workers = WorkerTable(lease_s=lease_s)
    streams = TokenStreams(gateway_bus, MODEL, GATEWAY_ID)
    await streams.start()
    handler = GatewayHandler(gateway_bus, MODEL, GATEWAY_ID, workers, streams, timeouts)
    state = ApiState(handler, model, GatewayMetrics(new_registry(False)), api_keys or [], max_request_bytes)
    output_ids = model.tokenizer.encode(output_text, add_special_tokens=False)
    fake = FakeWorkers(worker_bus, MODEL, output_ids, **fake_options)
    await fake.start()
    return Harness(create_app(state), state, fake, workers, model.tokenizer)
