"""Wiring only: settings → lifecycle (deepinfer.service) → model metadata → GatewayHandler (API server + pipeline).

With `processes` > 1 (unset: one per 4 usable cores) this process is the parent of that many gateway processes
sharing the API port (services.gateway.pool) and never loads the API app itself.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import TYPE_CHECKING

from deepinfer.config import GatewaySettings, load_settings
from deepinfer.service import ServiceContext, service_main

if TYPE_CHECKING:
    from services.gateway.handler import GatewayHandler

logger = logging.getLogger(__name__)


async def build(ctx: ServiceContext[GatewaySettings]) -> GatewayHandler:
    """Load the tokenizer (no weights), then build the gateway on the runtime's bus and registry."""
    from deepinfer.model_store import resolve_model
    from services.gateway.handler import GatewayHandler
    from services.gateway.recipe import ModelInfo, model_sampling_defaults

    settings = ctx.settings
    common = settings.common
    model_dir = await asyncio.to_thread(resolve_model, common.model, common.model_cache_dir, False)
    served_model_name = common.served_model_name or common.model
    default_sampling = {}
    if settings.sampling_defaults == "model":
        default_sampling = model_sampling_defaults(model_dir, common.model)
        if default_sampling:
            logger.info("sampling defaults of the model, for fields a request leaves out: %s "
                        "(DEEPINFER_GATEWAY_SAMPLING_DEFAULTS=openai: none)", default_sampling)
    model = await asyncio.to_thread(
        ModelInfo.from_dir, model_dir, served_model_name, None, settings.max_prompt_chars, default_sampling
    )
    _ = model.chat_encoder  # built (and checked on its probes) before the first request, not by it
    gateway = GatewayHandler(settings, ctx.bus, ctx.registry, model, ctx.tracer)
    ctx.advertise_port("api", settings.port)
    return gateway


#: Young-generation collection threshold once serving (Python's default: 700 allocations).
GC_THRESHOLD_0 = 10_000


async def build_serving(ctx: ServiceContext[GatewaySettings]) -> GatewayHandler:
    """`build`, then the collector tuned for serving: what the build made (tokenizer, models, the app: ~76k
    objects) moves to the permanent generation, so a full collection no longer walks it (50-60 ms with the loop
    stopped, every few hundred requests, before; ~3 ms after), and young collections run every 10k allocations
    instead of 700 (bench/gateway/gateway_burst.py: the collector was 16-17% of the gateway's CPU under bursts, 2-3% after;
    docs/serving-path.md). Only the service does this, not the tests that build gateways in their process."""
    gateway = await build(ctx)
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD_0, *gc.get_threshold()[1:])
    return gateway


def main() -> int:
    """`python -m services.gateway`: one gateway process, or the parent of several."""
    settings = load_settings(GatewaySettings)
    num_processes = settings.resolved_processes()
    if num_processes > 1:
        from services.gateway.pool import run_pool

        return run_pool(settings, num_processes)
    return service_main(GatewaySettings, build_serving)
