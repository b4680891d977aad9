"""Composition root of the prefill worker: settings → runtime (bus, telemetry, signals) → handler."""

from __future__ import annotations

from deepinfer.config import PrefillSettings
from deepinfer.service import ServiceContext, service_main
from services.prefill.handler import PrefillHandler


async def build(ctx: ServiceContext[PrefillSettings]) -> PrefillHandler:
    """Load the model and bind the data plane; the lifecycle then starts the handler."""
    handler = PrefillHandler(ctx)
    await handler.load()
    assert handler.data_plane is not None
    ctx.advertise_port("data_plane", handler.data_plane.port)
    return handler


def main() -> int:
    """`python -m services.prefill` / `deepinfer serve prefill`: run until SIGTERM; the exit code."""
    return service_main(PrefillSettings, build)
