"""Wiring only: settings → lifecycle (deepinfer.service) → model metadata → GatewayHandler (API server + pipeline)."""

from __future__ import annotations

import asyncio

from deepinfer.config import GatewaySettings
from deepinfer.model_store import resolve_model
from deepinfer.service import ServiceContext, service_main
from services.gateway.handler import GatewayHandler
from services.gateway.recipe import ModelInfo


async def build(ctx: ServiceContext[GatewaySettings]) -> GatewayHandler:
    """Load the tokenizer (no weights), then build the gateway on the runtime's bus and registry."""
    settings = ctx.settings
    common = settings.common
    model_dir = await asyncio.to_thread(resolve_model, common.model, common.model_cache_dir, False)
    served_model_name = common.served_model_name or common.model
    model = await asyncio.to_thread(ModelInfo.from_dir, model_dir, served_model_name)
    gateway = GatewayHandler(settings, ctx.bus, ctx.registry, model, ctx.tracer)
    ctx.advertise_port("api", settings.port)
    return gateway


def main() -> int:
    """`python -m services.gateway`."""
    return service_main(GatewaySettings, build)
