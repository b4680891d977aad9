"""Root fixtures: a private nats-server for the session, a connected bus per test, and the `gpu` marker.

Nothing heavy here: torch is imported only when gpu-marked tests were collected, so the suite also runs
where torch is absent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported in the fixtures, so gpu tests run where nats-py / pydantic are absent
    from deepinfer.bus import Bus
    from deepinfer.nats_server import NatsServer


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """A nats-server on a free loopback port with a generated token, shared by the session.

    Never restart or reconfigure it in a test: tests that need that start their own NatsServer.
    """
    from deepinfer.nats_server import NatsServer

    server = NatsServer()
    server.start()
    yield server
    server.close()


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    """A Bus connected to the session's nats-server, drained and closed after the test."""
    from deepinfer.bus import Bus

    connected = await Bus.connect(nats_server.url, name="pytest", token=nats_server.token)
    yield connected
    await connected.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu`-marked tests when no accelerator (or no torch) is available."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _no_accelerator_reason()
    if reason is None:
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))


def _no_accelerator_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs an accelerator: torch is not installed"
    if torch.cuda.is_available():
        return None
    npu = getattr(torch, "npu", None)  # present only when torch_npu is loaded
    if npu is not None and npu.is_available():
        return None
    return "needs an accelerator: none available (torch.cuda.is_available() is False)"
