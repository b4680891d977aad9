"""The gateway process object: readiness from heartbeats, the API on a real port, drain; torch never imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

import deepinfer
from deepinfer.nats_server import free_port
from deepinfer.service import ServiceContext
from deepinfer.telemetry import new_registry
from deepinfer.testing import FakeBroker, FakeBus
from deepinfer.testing.checkpoints import write_tokenizer_dir
from deepinfer.testing.fake_workers import FakeWorkers
from services.gateway.main import build
from tests.gateway_harness import ANSWER, MODEL, gateway_settings

GATEWAY_DIR = Path(__file__).resolve().parents[2] / "services" / "gateway"
GATEWAY_MODULES = [p.stem for p in GATEWAY_DIR.glob("*.py") if p.stem not in ("__init__", "__main__")]


async def test_gateway_ready_serves_and_drains(tmp_path: Path):
    broker = FakeBroker()
    settings = gateway_settings(write_tokenizer_dir(tmp_path), port=free_port(), api_keys=["sk-1"])
    gateway = await build(ServiceContext("gateway", settings, FakeBus(broker), new_registry(False), None))
    fake = FakeWorkers(FakeBus(broker), MODEL, gateway.state.model.tokenizer.encode(ANSWER))
    await fake.start()
    await gateway.start()
    api = f"http://127.0.0.1:{gateway.port}"
    try:
        assert not gateway.is_ready() and "decode" in gateway.not_ready_reason()
        # /health and /version on the API port, without the API key (load balancers probe them)
        async with httpx.AsyncClient(base_url=api) as http:
            health = await http.get("/health")
            assert health.status_code == 503 and "decode" in health.json()["error"]["message"]
            assert (await http.get("/version")).json() == {"version": deepinfer.__version__}
        await fake.heartbeat()
        await broker.settle()
        assert gateway.is_ready(), gateway.not_ready_reason()
        async with httpx.AsyncClient(base_url=api) as anonymous:
            assert (await anonymous.get("/health")).status_code == 200
            assert (await anonymous.get("/v1/models")).status_code == 401  # the API itself still needs the key
        async with httpx.AsyncClient(base_url=api, headers={"Authorization": "Bearer sk-1"}) as http:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            response = await http.post("/v1/chat/completions", json=body)
            assert response.json()["choices"][0]["message"]["content"] == ANSWER
            gateway.state.accepting = False  # what drain does first: new requests get 503
            refused = await http.post("/v1/chat/completions", json=body)
            assert refused.status_code == 503
            assert (await http.get("/health")).status_code == 503
        await gateway.drain(grace_s=1.0)
        assert not gateway.is_ready() and gateway.not_ready_reason() == "draining"
    finally:
        await gateway.close()
        await fake.stop()


async def test_two_gateways_share_one_api_port_and_both_serve(tmp_path: Path):
    broker = FakeBroker()
    port = free_port()
    gateways = []
    for index in range(2):
        settings = gateway_settings(write_tokenizer_dir(tmp_path / f"m{index}"), port=port, reuse_port=True,
                                    gateway_id=f"gw-{index}")
        gateways.append(await build(ServiceContext("gateway", settings, FakeBus(broker), new_registry(False), None)))
    fake = FakeWorkers(FakeBus(broker), MODEL, gateways[0].state.model.tokenizer.encode(ANSWER))
    await fake.start()
    for gateway in gateways:
        await gateway.start()  # the second bind succeeds: SO_REUSEPORT
    try:
        await fake.heartbeat()
        await broker.settle()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(24):  # a new connection each time: the kernel spreads them over both listeners
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        served = [g.state.metrics.requests.labels("chat", "200")._value.get() for g in gateways]
        assert sum(served) == 24 and min(served) > 0, served
    finally:
        for gateway in gateways:
            await gateway.close()
        await fake.stop()


def test_every_gateway_module_imports_without_torch():
    assert "app" in GATEWAY_MODULES and "main" in GATEWAY_MODULES
    imports = "".join(f"import services.gateway.{module}\n" for module in GATEWAY_MODULES)
    code = f"import sys\nsys.modules['torch'] = None\n{imports}assert sys.modules.get('torch') is None\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
