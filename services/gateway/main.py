"""Wiring only: settings → lifecycle (deepinfer.service) → model metadata → Gateway (API server + handler)."""

from __future__ import annotations

import asyncio

from deepinfer.config import GatewaySettings
from deepinfer.model_store import resolve_model
from deepinfer.service import ServiceContext, service_main
from services.gateway.handler import GatewayTimeouts
from services.gateway.metrics import GatewayMetrics
from services.gateway.recipe import ModelInfo
from services.gateway.runtime import Gateway


async def build(ctx: ServiceContext[GatewaySettings]) -> Gateway:
    """Load the tokenizer (no weights), then build the gateway on the runtime's bus and registry."""
    settings = ctx.settings
    common = settings.common
    model_dir = await asyncio.to_thread(resolve_model, common.model, common.model_cache_dir, False)
    served_model_name = common.served_model_name or common.model
    model = await asyncio.to_thread(ModelInfo.from_dir, model_dir, served_model_name)
    gateway = Gateway(
        ctx.bus,
        model,
        settings.gateway_id,
        GatewayMetrics(ctx.registry),
        settings.host,
        settings.port,
        settings.api_keys,
        int(settings.max_request_bytes),
        timeouts=GatewayTimeouts(
            route_timeout_s=settings.route_timeout_s,
            prefill_timeout_s=settings.prefill_timeout_s,
            decode_timeout_s=settings.decode_timeout_s,
            stream_timeout_s=settings.stream_timeout_s,
        ),
        worker_lease_s=settings.worker_lease_s,
    )
    ctx.advertise_port("api", settings.port)
    return gateway


def main() -> int:
    """`python -m services.gateway`."""
    return service_main(GatewaySettings, build)
