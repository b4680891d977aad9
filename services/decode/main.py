"""Composition root of the decode worker: settings → runtime (bus, telemetry, signals) → handler."""

from __future__ import annotations

from deepinfer.config import DecodeSettings
from deepinfer.service import ServiceContext, service_main
from services.decode.handler import DecodeHandler


async def build(ctx: ServiceContext[DecodeSettings]) -> DecodeHandler:
    """Load the model; the lifecycle then starts the handler."""
    handler = DecodeHandler(ctx)
    await handler.load()
    return handler


def main() -> int:
    """`python -m services.decode` / `deepinfer serve decode`: run until SIGTERM; the exit code."""
    return service_main(DecodeSettings, build)
